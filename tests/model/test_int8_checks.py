"""The live checks (``--verify-fraction``) at the default precision on quantized weights: every
stage and the coordinator's reference round activations to int8 blocks (``precision.apply`` in
both processes), and a stage runs many sequences' rows in one step. Unchecked, past
``quant.matmul.DECODE_ROWS`` rows (AMX_BELOW_ROWS with AMX) its matmuls multiply dequantised
bfloat16 tiles, where the reference runs each sequence's rows alone. A checked mesh computes
every row as it would alone (``Precision.rows_alone``: the fused int8 kernel whatever a step's
rows, and each row's attention as a decode row's, whatever chunk of its prompt it came in), and
its digests are held to ``digest.ALONE_TOLERANCE``.

Measured on the embedded model (Q4_1, bfloat16 activations), split [0,15)+[15,30), gaps in
units of the bfloat16 tolerance (``digest.differs``), unchecked: decode rows batched 13-160 to a
step, median 0.28, largest 0.55 (13 rows) to 2.2 (160); prompts batched 160-320 rows to a step,
median 0.10, largest 1.4-2.9 (prompts of 5-60 tokens batched, then their decode rows, over three
stages: 5.3); a row scaled by 1.05: 0.85. No such tolerance passes the one and catches the other.
Rows computed alone: 8-160 decode rows and 320 prompt rows a step were the reference's to the
bit, their digests 0 apart (5.4e-8 of their scale with the stage at one thread, the reference at
two); a row scaled by 1.05 is 51x ``ALONE_TOLERANCE``. A prompt run whole against the same
prompt in two chunks (a prefix fork's donor against the reference catching up): 0, where
attending over each chunk at once put its rows 21-26x ``ALONE_TOLERANCE`` apart. Plain
bfloat16 (no int8 blocks) has the same dependence past ``EXACT_BLOCK_ROWS`` rows (bfloat16
tiles): 80 decode rows, largest 1.3, 320 prompt rows 1.4 (in bfloat16 tolerances); up to it
rows are exact's, to the bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from seamline.app import default_model_path
from seamline.mesh.control.reference import Reference
from seamline.model.attention import GQAttention
from seamline.model.cache import Span
from seamline.model.mla import MLAttention
from seamline.model.stage import Stage
from seamline.precision import Precision, apply, checked, int8_kernels_here, resolve
from seamline.quant import matmul
from seamline.runtime import digest
from seamline.weights.loader import load_stage
from seamline.weights.packaging import package_cached
from tests.support.configs import checkpoint_source

SPLIT = ((0, 15), (15, 30))
SEQUENCES = 16  # decode rows in one step: past DECODE_ROWS, as a busy stage batches them
PROMPT = 5
SEED = 12345
Digests = list[tuple[torch.Tensor, torch.Tensor]]  # per stage: (input, output)

needs_int8 = pytest.mark.skipif(
    not int8_kernels_here(), reason="int8-block kernels need x86-64 with AVX-512 VNNI"
)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Reference, Reference]]:
    """The member's copy and the coordinator's, both at the default precision of a checked mesh."""
    package = package_cached(
        default_model_path(), tmp_path_factory.mktemp("package"), progress=False
    )
    was = matmul.INT8_ACTIVATIONS, matmul.ROWS_ALONE
    apply(checked(Precision("fast", "bfloat16", True)))
    try:
        yield Reference(package, "bfloat16", True), Reference(package, "bfloat16", True)
    finally:
        matmul.set_int8_activations(was[0])
        matmul.set_rows_alone(was[1])


def _member_step(
    stages: list[Stage], caches: list[list[object]], ids: torch.Tensor, position: int
) -> list[Digests]:
    """One step of every sequence (``ids[i]``: sequence ``i``'s rows at ``position``...) through
    the stages, batched as a busy stage runs them; each sequence's digests as its stages report
    them (the last stage: its last row's logits)."""
    batch, count = ids.shape
    x: torch.Tensor = ids.reshape(-1)
    out: list[Digests] = [[] for _ in range(batch)]
    for k, stage in enumerate(stages):
        spans = [Span(i * count, count, position, c[k]) for i, c in enumerate(caches)]  # type: ignore[arg-type]
        last = k == len(stages) - 1
        y = stage.forward_batch(x, spans, last_only=last)
        for i in range(batch):
            rows = slice(i * count, (i + 1) * count)
            got_in = digest.digest(x[rows], position, SEED) if k else torch.zeros(1)
            got_out = (
                digest.digest(y[i : i + 1], position + count - 1, SEED)
                if last
                else digest.digest(y[rows], position, SEED)
            )
            out[i].append((got_in, got_out))
        x = y
    return out


def _gaps(
    reference: Reference, caches: list[object], ids: torch.Tensor, position: int, got: Digests
) -> list[float]:
    """The row alone through the reference's stages: each stage's input and output gap."""
    x: torch.Tensor = ids
    gaps = []
    for k, layers in enumerate(SPLIT):
        stage = reference.stage(layers)
        if k:
            gaps.append(_gap(got[k][0], x, position))
        last = k == len(SPLIT) - 1
        x = reference.run(stage, x, position, caches[k], last, ids)
        gaps.append(_gap(got[k][1], x, position + ids.shape[0] - 1 if last else position))
    return gaps


def _gap(got: torch.Tensor, x: torch.Tensor, position: int) -> float:
    expected, scale = digest.digest(x, position, SEED), digest.scale(x, position, SEED)
    return digest.differs(got, expected, scale, torch.bfloat16, matmul.ROWS_ALONE)


def _prefilled(reference: Reference, prompts: torch.Tensor) -> list[list[object]]:
    """Each prompt alone through ``reference``'s stages, on caches of its own."""
    all_caches = []
    for prompt in prompts:
        caches = [reference.stage(layers).new_cache() for layers in SPLIT]
        x: torch.Tensor = prompt
        for k, layers in enumerate(SPLIT):
            x = reference.run(reference.stage(layers), x, 0, caches[k], k == len(SPLIT) - 1, prompt)
        all_caches.append(caches)
    return all_caches


def _decode_gaps(references: tuple[Reference, Reference], batch: int) -> list[float]:
    """Each of ``batch`` prompts prefilled alone on both sides, then one decode step of all
    ``batch`` rows on the member against each row alone on the reference."""
    member, coordinator = references
    generator = torch.Generator().manual_seed(batch)
    prompts = torch.randint(100, 20000, (batch, PROMPT), generator=generator)
    rows = torch.randint(100, 20000, (batch,), generator=generator)
    mine, theirs = _prefilled(member, prompts), _prefilled(coordinator, prompts)
    stages = [member.stage(layers) for layers in SPLIT]
    got = _member_step(stages, mine, rows[:, None], PROMPT)
    return [
        g
        for i in range(batch)
        for g in _gaps(coordinator, theirs[i], rows[i : i + 1], PROMPT, got[i])
    ]


def _prompt_gaps(references: tuple[Reference, Reference], batch: int) -> list[float]:
    """``batch`` prompts prefilled in one step on the member against each alone on the reference."""
    member, coordinator = references
    prompts = torch.randint(100, 20000, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    mine = [[member.stage(layers).new_cache() for layers in SPLIT] for _ in range(batch)]
    got = _member_step([member.stage(layers) for layers in SPLIT], mine, prompts, 0)
    theirs = [[coordinator.stage(layers).new_cache() for layers in SPLIT] for _ in range(batch)]
    return [g for i in range(batch) for g in _gaps(coordinator, theirs[i], prompts[i], 0, got[i])]


@needs_int8
def test_rows_computed_alike_are_the_references_to_the_bit(
    references: tuple[Reference, Reference],
) -> None:
    """Decode rows below AMX_FROM_ROWS: the fused int8 kernel on every CPU, a row's sums its own."""
    gaps = _decode_gaps(references, matmul.AMX_FROM_ROWS - 1)
    print("gaps, in tolerances:", max(gaps))
    assert max(gaps) == 0.0, gaps


def test_only_a_checked_mesh_computes_rows_alone() -> None:
    """The unchecked default keeps the faster kernels past DECODE_ROWS; a checked mesh's
    precision computes rows alone only where it has int8 blocks."""
    fast = resolve("fast", "quantized")
    assert not fast.rows_alone
    assert checked(fast).rows_alone == fast.int8_activations
    assert not checked(resolve("exact", "quantized")).rows_alone


@needs_int8
def test_an_honest_stage_that_batches_decode_rows_passes_the_check(
    references: tuple[Reference, Reference],
) -> None:
    """SEQUENCES decode rows in one step: past DECODE_ROWS and AMX_FROM_ROWS."""
    gaps = _decode_gaps(references, SEQUENCES)
    print("gaps, in tolerances:", max(gaps))
    assert max(gaps) <= 1, max(gaps)


@needs_int8
def test_an_honest_stage_that_batches_prompts_passes_the_check(
    references: tuple[Reference, Reference],
) -> None:
    """Prompts in one step of twice AMX_BELOW_ROWS rows: past every kernel's switch."""
    gaps = _prompt_gaps(references, 2 * -(-matmul.AMX_BELOW_ROWS // PROMPT))
    print("gaps, in tolerances: max", max(gaps), "median", sorted(gaps)[len(gaps) // 2])
    assert max(gaps) <= 1, max(gaps)


@needs_int8
def test_a_prompt_run_in_other_chunks_is_the_same_to_the_bit(
    references: tuple[Reference, Reference],
) -> None:
    """A stage that ran a prompt whole (a prefix fork's donor) against the reference catching
    up on it in two chunks: every row's attention and matmuls are its own."""
    member, coordinator = references
    ids = torch.randint(100, 20000, (53,), generator=torch.Generator().manual_seed(5))
    cut = 24
    whole: torch.Tensor = ids
    first, second = ids[:cut], ids[cut:]
    gaps = []
    for layers in SPLIT:
        mine, theirs = member.stage(layers), coordinator.stage(layers)
        cache = theirs.new_cache()
        whole = member.run(mine, whole, 0, mine.new_cache(), False, ids)
        first = coordinator.run(theirs, first, 0, cache, False, ids[:cut])
        second = coordinator.run(theirs, second, cut, cache, False, ids[cut:])
        gaps.append(_gap(digest.digest(whole[cut:], cut, SEED), second, cut))
    print("gaps, in tolerances:", gaps)
    assert max(gaps) == 0.0, gaps


@needs_int8
def test_a_row_scaled_by_1_05_is_caught(references: tuple[Reference, Reference]) -> None:
    """0.05 of its scale away: caught by a wide margin (51x ``ALONE_TOLERANCE``)."""
    _, coordinator = references
    stage = coordinator.stage(SPLIT[0])
    cache = stage.new_cache()
    ids = torch.tensor([1, 330, 3458, 282, 4649])
    coordinator.run(stage, ids[:4], 0, cache, False, ids[:4])
    row = coordinator.run(stage, ids[4:], 4, cache, False, ids[4:])
    gap = _gap(digest.digest(row * 1.05, 4, SEED), row, 4)
    print("a 1.05-scaled row, in tolerances:", gap)
    assert gap > 10, gap


@needs_int8
def test_a_stage_answers_its_start_up_probe_as_the_reference_to_the_bit(
    references: tuple[Reference, Reference],
) -> None:
    """The probe's few rows run on the int8 blocks on both sides: the whole range at once on the
    stage, a layer at a time on the reference."""
    member, coordinator = references
    generator = torch.Generator().manual_seed(3)
    for layers in ((0, 15), (15, 30)):
        for seed in range(3):
            ids, hidden = coordinator.probe_inputs(layers, generator)
            output, start = digest.probe_output(member.stage(layers), ids, hidden)
            expected, scale = coordinator.probe(layers, ids, hidden, seed)
            got = digest.digest(output, start, seed)
            assert digest.differs(got, expected, scale, torch.bfloat16) == 0.0, (layers, seed)


@pytest.mark.parametrize("kind", ["dense", "deepseek_v3"])
def test_rows_computed_alone_attend_as_decode_rows_in_every_attention(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Grouped-query and DeepSeek's latent attention alike: a prompt chunk's rows attend one at a
    time when rows are computed alone (a checked mesh), so the chunk a row came in changes
    nothing; otherwise the chunk attends at once. Both give the same rows within rounding."""
    stage = load_stage(checkpoint_source(kind, tmp_path))
    module = MLAttention if kind == "deepseek_v3" else GQAttention
    calls: list[int] = []
    attend = module._attend

    def counted(self: object, rows: torch.Tensor, *rest: object) -> torch.Tensor:
        calls.append(rows.shape[0])
        return attend(self, rows, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "_attend", counted)
    ids = torch.arange(5, 25)
    outputs, counts = [], []
    for alone in (False, True):
        monkeypatch.setattr(matmul, "ROWS_ALONE", alone)
        calls.clear()
        outputs.append(stage.forward_batch(ids, [Span(0, len(ids), 0, stage.new_cache())]))
        counts.append(set(calls))
    # alone, no call attends more than one row (grouped-query rows go to the fused decode op)
    assert counts[0] == {len(ids)} and counts[1] <= {1}, counts
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)
