"""DeepSeek-V4 as seamline loads and runs it, against transformers' DeepseekV4ForCausalLM.

The checkpoint is a real folder that transformers wrote (``tests/v4_reference.py``); seamline
reads it through its loader, as a Stage of the whole model or of a layer range. Logits are
compared within 1e-4 (float32 on both sides), greedy tokens exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from seamline.errors import CheckpointError
from seamline.model.cache import Span
from seamline.ownership import Ownership
from seamline.params import SamplingParams
from seamline.runtime.engine import Engine
from seamline.weights.loader import load_stage, open_source
from tests.support.v4_reference import reference_logits, save_random_v4

PROMPT = 13


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("v4")
    reference = save_random_v4(folder)
    return folder, reference, load_stage(open_source(folder))


def _ids(seed: int, count: int = PROMPT) -> torch.Tensor:
    return torch.randint(0, 96, (count,), generator=torch.Generator().manual_seed(seed))


def test_v4_logits_equal_the_reference_at_once_in_chunks_and_decoding(checkpoint) -> None:  # type: ignore[no-untyped-def]
    _, reference, stage = checkpoint
    ids = _ids(2)
    expected = reference_logits(reference, ids)
    assert expected.abs().max() > 1.0  # logits with a spread worth comparing
    torch.testing.assert_close(stage(ids, 0, stage.new_cache()), expected, rtol=0, atol=1e-4)
    cache = stage.new_cache()
    rows = [stage(ids[:5], 0, cache), stage(ids[5:9], 5, cache)]
    rows += [stage(ids[p : p + 1], p, cache) for p in range(9, PROMPT)]
    torch.testing.assert_close(torch.cat(rows), expected, rtol=0, atol=1e-4)
    assert 0 < cache.nbytes() <= stage.cache_bytes(PROMPT)


def test_sequences_batched_in_one_step_equal_each_alone(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A prefill chunk and two decode rows of other sequences in one step: each row's logits
    equal its sequence run alone."""
    _, _, stage = checkpoint
    prompts = [_ids(5), _ids(6, 7), _ids(7, 11)]
    alone = [stage(p, 0, stage.new_cache()) for p in prompts]
    caches = [stage.new_cache() for _ in prompts]
    stage(prompts[1][:6], 0, caches[1])
    stage(prompts[2][:10], 0, caches[2])
    rows = torch.cat([prompts[0], prompts[1][6:], prompts[2][10:]])
    spans = [
        Span(0, PROMPT, 0, caches[0]),
        Span(PROMPT, 1, 6, caches[1]),
        Span(PROMPT + 1, 1, 10, caches[2]),
    ]
    out = stage.forward_batch(rows, spans)  # type: ignore[arg-type]
    torch.testing.assert_close(out[:PROMPT], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[PROMPT], alone[1][6], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[PROMPT + 1], alone[2][10], rtol=0, atol=1e-5)


def test_two_stages_passing_the_residual_and_the_ids_equal_the_whole(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Layers [0, 2) and [2, 3) loaded as two stages, each reading its own tensors only: the
    first's output is the residual [T, 4, 32]; with the ids, the second's logits equal the
    whole's, at once and decoding."""
    from seamline.model.v4_stage import boundary_bytes

    folder, _, whole = checkpoint
    first = load_stage(open_source(folder), Ownership(layers=(0, 2)))
    second = load_stage(open_source(folder), Ownership(layers=(2, 3)))
    assert first.head is None and second.embed is None and len(second.layers) == 1
    ids = _ids(3)
    expected = whole(ids, 0, whole.new_cache())
    caches = (first.new_cache(), second.new_cache())
    residual = first(ids[:9], 0, caches[0])
    assert residual.shape == (9, 4, 32)
    rows = [second(residual, 0, caches[1], ids=ids[:9])]  # type: ignore[call-arg]
    for p in range(9, PROMPT):
        rows.append(second(first(ids[p : p + 1], p, caches[0]), p, caches[1], ids=ids[p : p + 1]))  # type: ignore[call-arg]
    torch.testing.assert_close(torch.cat(rows), expected, rtol=0, atol=1e-5)
    assert boundary_bytes(whole.config, torch.bfloat16) == 4 * 32 * 2 + 4
    with pytest.raises(ValueError, match="need the tokens' ids"):
        second(residual[:2], 0, second.new_cache())


def test_32_greedy_tokens_from_the_engine_equal_the_reference(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The engine's scheduler decodes through the caches; the reference's token at each step
    is the argmax of its logits over the whole sequence so far, computed afresh (no cache)."""
    _, reference, stage = checkpoint
    ids = _ids(4)
    mine = list(
        Engine(stage).generate(ids.tolist(), SamplingParams(max_tokens=32, temperature=0.0))
    )
    theirs, sequence = [], ids.tolist()
    for _ in range(32):
        theirs.append(int(reference_logits(reference, torch.tensor(sequence))[-1].argmax()))
        sequence.append(theirs[-1])
    assert mine == theirs


def _rewritten(folder: Path, to: Path, change) -> Path:  # type: ignore[no-untyped-def]
    to.mkdir()
    (to / "config.json").write_text((folder / "config.json").read_text())
    save_file(change(load_file(str(folder / "model.safetensors"))), str(to / "model.safetensors"))
    return to


def test_a_missing_indexer_tensor_or_a_hash_table_of_the_wrong_size_is_named(
    checkpoint, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    folder = checkpoint[0]
    for name in (
        "model.layers.1.attn.indexer.wq_b.weight",
        "model.layers.2.attn.compressor.wgate.weight",
    ):
        without = _rewritten(
            folder,
            tmp_path / name,
            lambda state: {k: v for k, v in state.items() if k != name},  # noqa: B023 (called at once)
        )
        with pytest.raises(CheckpointError, match=f"missing tensor {name}".replace(".", r"\.")):
            load_stage(open_source(without))
    table = "model.layers.0.ffn.gate.tid2eid"
    wrong = _rewritten(
        folder, tmp_path / "b", lambda state: {**state, table: torch.zeros(95, 2, dtype=torch.long)}
    )
    with pytest.raises(
        CheckpointError, match=r"tid2eid gives layers\.0\.ffn\.table shape \(95, 2\)"
    ):
        load_stage(open_source(wrong))
    floats = _rewritten(
        folder, tmp_path / "c", lambda state: {**state, table: state[table].float()}
    )
    with pytest.raises(
        CheckpointError, match=r"tid2eid has dtype torch.float32, expected integers"
    ):
        load_stage(open_source(floats))


def test_the_planner_and_the_scheduler_count_each_layer_kinds_cache(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Per layer kind: a sliding layer keeps its window, a heavily compressed one an entry per
    3 tokens, a sparse one an entry per 2 and its indexer's. The planner's bytes per layer are
    those of a sequence of the planned context; what a real cache holds stays within them."""
    from seamline.config import v4_cache_bytes
    from seamline.errors import RequestError
    from seamline.mesh.plan.types import ModelSpec
    from seamline.runtime.scheduler import Scheduler

    folder, _, stage = checkpoint
    source, config, tokens = open_source(folder), stage.config, 64
    shapes, types = (
        {n: source.shape(n) for n in source.names()},
        {n: source.stored_type(n) for n in source.names()},
    )
    spec = ModelSpec.from_checkpoint_shapes(config, "v4", shapes, 4, types, context=tokens)
    kv = spec.layer_kv()
    assert kv[0] < kv[2] < kv[1]  # sliding < heavily compressed < compressed sparse
    assert spec.bytes_per_boundary_per_token == 4 * 32 * 4 + 4
    cache = stage.new_cache()
    stage(_ids(8, tokens), 0, cache)
    for layer in range(3):
        held, bound = (
            cache.layer(layer).nbytes(),
            v4_cache_bytes(config, range(layer, layer + 1), tokens, 4),
        )
        assert held <= bound <= held * 1.25 + 256, (layer, held, bound)
        assert kv[layer] == -(-bound // tokens)
    scheduler = Scheduler(stage, 256, kv_budget_bytes=stage.cache_bytes(100) - 1)
    need = f"{stage.cache_bytes(100) / 2**20:.4g}".replace(".", r"\.")
    with pytest.raises(RequestError, match=rf"may need {need} MiB of KV cache"):
        scheduler.add(_ids(9, 50).tolist(), SamplingParams(max_tokens=50))
    scheduler.add(_ids(9, 50).tolist(), SamplingParams(max_tokens=49))
    assert (
        not scheduler.forks and scheduler.prefix.capacity_bytes == 0
    )  # V4's caches are not forked


def _state(cache) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Every tensor a V4 cache holds, layer by layer."""
    held = []
    for layer in cache.layers.values():
        held += [layer.kv, torch.tensor(layer.length)]
        for state in (layer.compressed, layer.indexed):
            held += [t for t in (state.tail_kv, state.tail_gate, state.entries) if t is not None]
    return held


@pytest.mark.parametrize("back", [1, 5, 9])
def test_a_window_taken_back_leaves_the_cache_of_a_run_that_never_drafted(
    checkpoint, back: int
) -> None:  # type: ignore[no-untyped-def]
    """A window of 9 rows (drafts) whose last ``back`` were rejected: the next step starts
    there. The caches (window keys, compressors' rows and entries, indexer's) and the logits
    after it equal a run that only ever took the accepted tokens; going back past what a cache
    keeps is refused with the positions named."""
    from seamline.config import V4_REWIND_REACH

    _, _, stage = checkpoint
    ids, drafts = _ids(4, 20), _ids(5, 9)
    accepted = 9 - back
    drafted, plain = stage.new_cache(), stage.new_cache()
    stage(ids, 0, drafted)
    stage(drafts, 20, drafted)  # positions 20..28
    stage(ids, 0, plain)
    if accepted:
        stage(drafts[:accepted], 20, plain)
    after = _ids(6, 3)
    torch.testing.assert_close(
        stage(after, 20 + accepted, drafted), stage(after, 20 + accepted, plain), rtol=0, atol=1e-5
    )
    for a, b in zip(_state(drafted), _state(plain), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    far = 23 + accepted + V4_REWIND_REACH + 1
    stage(_ids(7, far - 23 - accepted), 23 + accepted, drafted)
    with pytest.raises(ValueError, match=f"holds {far} positions; it cannot go back"):
        stage(after[:1], far - V4_REWIND_REACH - 1, drafted)
