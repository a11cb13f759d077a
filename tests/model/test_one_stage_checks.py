"""The coordinator checks one stage of a followed request, on its own copy of that stage's layers
only (``mesh.control.verify``): driven in this process with three stages of the embedded model
computed honestly (or one of them not) and reporting as a mesh's stages report.

The verifier holds one range at a time while it checks, and none once the request is closed; a
stage that scales its output is caught when its stage is the chosen one, before any of its
tokens is passed on (the request's later tokens are the mesh's to refuse: its plan is replaced).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from seamline.app import default_model_path
from seamline.mesh.control import verify
from seamline.mesh.control.reference import Reference
from seamline.mesh.control.verify import CheckedStage, Verifier
from seamline.mesh.node import kept_rows as kept_rows_module
from seamline.mesh.node.kept_rows import kept_rows
from seamline.net.frames import EMPTY_HASH, RowFlag, TokenRow
from seamline.net.messages import Digests, KeptRows, KeptRowsAsk, Message, Open
from seamline.params import SamplingParams
from seamline.runtime import digest
from seamline.runtime.kept_inputs import KeptInputs
from seamline.runtime.sampling import draw
from seamline.weights.packaging import package_cached

RANGES = [(0, 10), (10, 20), (20, 30)]
NODES = ["a", "b", "c"]
PROMPT = [1, 504, 3458, 282, 4649, 30, 2]
DECODED = 3  # tokens drawn after the prompt


class HonestMesh:
    """Three stages run on a copy of the model of their own; each step reports its digests, and
    the stage asked shows the rows it took. ``scale``: the stage that multiplies its output."""

    def __init__(self, package: Path, seed: int, scale: int | None = None) -> None:
        self.copy = Reference(package, "float32")
        self.stages = [self.copy.stage(layers) for layers in RANGES]
        self.caches = [stage.new_cache() for stage in self.stages]
        self.taken: list[list[torch.Tensor]] = [[], [], []]  # each stage's input rows, in order
        self.seed, self.scale = seed, scale

    def step(self, tokens: list[int], position: int) -> tuple[list[Digests], torch.Tensor]:
        """The row [position, len(tokens)) through every stage: their reports, and the logits."""
        ids = torch.tensor(tokens[position:], dtype=torch.long)
        count, x = len(ids), ids
        reports = []
        for index, (stage, cache) in enumerate(zip(self.stages, self.caches)):
            last = index == len(self.stages) - 1
            if index > 0:
                self.taken[index].append(x)
            out = self.copy.run(stage, x, position, cache, last, ids)
            out = out * 1.05 if index == self.scale else out
            took = digest.digest(x, position, self.seed) if index else torch.zeros(16)
            start = position + count - 1 if last else position
            made = digest.digest(out, start, self.seed)
            reports.append(
                Digests(
                    plan_id=1,
                    layers=RANGES[index],
                    rows=[(7, position, count)],
                    digests=digest.pack(torch.stack([took, made]).view(1, 2, -1)),
                )
            )
            x = out
        return reports, x[-1]

    def show(self, ask: KeptRowsAsk) -> list[KeptRows]:
        """As a stage shows them: ``kept_rows`` over the rows it took."""
        worker = SimpleNamespace(kept=KeptInputs())
        worker.kept.keep(ask.request, 0, torch.cat(self.taken[RANGES.index(ask.layers)]))
        return kept_rows(worker, ask, 1)  # type: ignore[arg-type]


def _until(done: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _serve_one_request(
    package: Path,
    chosen: str,
    scale: int | None = None,
    group: bool = False,
    shows: bool = True,
) -> tuple[Verifier, list[TokenRow], list[int], list[str]]:
    """One followed request of the prompt and ``DECODED`` tokens through the mesh (``group``:
    its middle stage is a lockstep group of "b" and "b2"; ``shows``: whether the stage asked
    answers); the verifier, the tokens it
    released, the most ranges it held at once, and the nodes blamed."""
    ranks = [(n, "b2") if group and n == "b" else (n,) for n in NODES]
    reference = Reference(package, "float32")
    released: list[TokenRow] = []
    blamed: list[str] = []
    held: list[int] = []
    run = reference.run

    def counting_run(*args: object, **kwargs: object) -> torch.Tensor:
        held.append(len(reference.loaded()))
        return run(*args, **kwargs)  # type: ignore[arg-type]

    reference.run = counting_run  # type: ignore[method-assign]
    box: list[Verifier] = []
    asked_after: list[int] = []  # tokens drawn when the chosen stage was asked for its rows
    mesh: list[HonestMesh] = []

    def ask(node: str, message: Message) -> None:
        leader = next(r[0] for r in ranks if chosen in r)  # a group's leader shows its rows
        assert asked_after == [], "a stage is asked once, when the request has ended"
        asked_after.append(len(tokens))
        assert isinstance(message, KeptRowsAsk) and node == leader
        for part in mesh[0].show(message) if shows else []:
            box[0].kept_rows(node, part)

    verifier = Verifier(
        reference,
        1.0,
        released.extend,
        lambda nodes, why: blamed.extend([*nodes, f"after {len(released)} tokens"]),
        ask=ask,
        choice=chosen,
    )
    box.append(verifier)
    mesh.append(HonestMesh(package, verifier.seed, scale))
    verifier.plan([CheckedStage(r, n) for r, n in zip(RANGES, ranks)], plan_id=1)
    params = SamplingParams(temperature=0.0, max_tokens=DECODED)
    verifier.opened(
        Open(request=7, sampling=params, prompt_len=len(PROMPT), context_length=64), PROMPT
    )
    tokens, position = list(PROMPT), 0
    for drawn in range(1, DECODED + 1):
        reports, logits = mesh[0].step(tokens, position)
        for node, report in zip(NODES, reports):
            verifier.digests(node, report)
        token = int(draw(logits, params, 0, len(tokens), tokens[len(PROMPT) :], None).token)
        done = RowFlag.DONE if drawn == DECODED else RowFlag.NONE  # the request's last token
        row = TokenRow(7, len(tokens), token, EMPTY_HASH, EMPTY_HASH, flags=int(done))
        verifier.tokens([row])
        position = len(tokens)
        tokens.append(token)
    _until(lambda: len(released) == DECODED or bool(blamed), "the request was not checked")
    return verifier, released, held, blamed


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return package_cached(default_model_path(), tmp_path_factory.mktemp("pkg"), progress=False)


@pytest.mark.parametrize("chosen", NODES)
def test_the_coordinator_holds_only_the_chosen_stage_while_it_checks(
    package: Path, chosen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kept_rows_module, "PART_BYTES", 5000)  # the rows come in parts
    verifier, released, held, blamed = _serve_one_request(package, chosen)
    assert blamed == [] and verifier.violations == 0
    assert [r.position for r in released] == [len(PROMPT) + i for i in range(DECODED)]
    assert held and max(held) == 1, held  # one range loaded, never the whole model
    assert verifier.reference is not None
    assert [layers for layers, _ in verifier.reference.loaded()] == [RANGES[NODES.index(chosen)]]
    verifier.closed(7)
    _until(lambda: not verifier.reference.loaded(), "the checked range was not let go")  # type: ignore[union-attr]


@pytest.mark.parametrize("liar", [0, 1])
def test_a_stage_that_scales_its_output_is_caught_when_chosen(package: Path, liar: int) -> None:
    verifier, _, _, blamed = _serve_one_request(package, NODES[liar], scale=liar)
    assert blamed == [NODES[liar], "after 0 tokens"]  # its tokens were held until then
    assert verifier.violations == 1


def test_a_stage_not_chosen_is_not_computed(package: Path) -> None:
    """The scaling stage is not checked when another is chosen: its lie passes its links (it
    reports and sends what it computed), so only its own stage's check catches it."""
    verifier, released, held, blamed = _serve_one_request(package, "c", scale=1)
    assert blamed == [] and max(held) == 1
    assert verifier.reference is not None
    assert [layers for layers, _ in verifier.reference.loaded()] == [RANGES[2]]
    del released


def test_a_lockstep_group_is_checked_as_one_stage(package: Path) -> None:
    """Chosen through either rank, a group's range is computed as the group does (its shards on
    threads), and only it is held; a group whose leader scales its output has both ranks
    blamed."""
    verifier, released, held, blamed = _serve_one_request(package, "b2", group=True)
    assert blamed == [] and len(released) == DECODED and max(held) == 1
    assert verifier.reference is not None and verifier.reference.loaded() == [(RANGES[1], 2)]
    _, _, _, blamed = _serve_one_request(package, "b2", scale=1, group=True)
    assert blamed == ["b", "b2", "after 0 tokens"]


def test_a_chosen_stage_that_shows_no_rows_is_at_fault(
    package: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(verify, "WAIT_S", 0.5)
    verifier, released, _, blamed = _serve_one_request(package, "c", shows=False)
    _until(lambda: bool(blamed), "the silent stage was not blamed")
    assert blamed == ["c", "after 0 tokens"] and released == []
