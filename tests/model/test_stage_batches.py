"""Stage 0's runtime in one process (the split itself is tested over real sockets in
test_mesh.py): returned tokens of many sequences run as shared batches of at most 1/S of the
running sequences, prompts that arrive together are prefilled in shared chunks, a request
closed while it waits is never prefilled, and a KV budget preempts and recomputes across
the stages without changing a token."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from seamline.config import kv_bytes_per_token
from seamline.mesh.node.private_tail import pair
from seamline.model.stage import Stage
from seamline.net.frames import (
    EMPTY_HASH,
    HiddenFrame,
    Row,
    RowFlag,
    TokenFrame,
    TokenRow,
    prefix_hash,
)
from seamline.net.messages import Close, Message, Open, Prompt
from seamline.ownership import Ownership
from seamline.params import SamplingParams
from seamline.runtime.engine import Engine
from seamline.runtime.pipeline_head import MAX_STEP_TOKENS
from seamline.runtime.stage_rows import Work
from seamline.runtime.stage_worker import StageWorker
from seamline.weights.loader import load_stage, open_source
from tests.support.configs import checkpoint_source, dense_configs
from tests.support.pipeline import collect
from tests.support.reference import save_random_model

SEQUENCES = 6
Frames = list[tuple[list[Row], torch.Tensor]]


def _stages(folder: Path) -> tuple[Stage, Stage]:
    save_random_model(dense_configs()["llama"], folder)
    source = open_source(folder)
    return load_stage(source, Ownership(layers=(0, 1))), load_stage(
        source, Ownership(layers=(1, 3))
    )


def _open(
    worker: StageWorker, request: int, prompt: list[int], params: SamplingParams | None = None
) -> None:
    worker.open(
        Open(
            request=request,
            sampling=params or SamplingParams(max_tokens=8),
            prompt_len=len(prompt),
            context_length=1024,
        )
    )
    worker.prompt(Prompt(request=request, tokens=tuple(prompt)))


def _wait_for(frames: list, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(frames) < count:
        assert time.monotonic() < deadline, f"{len(frames)} frames sent, expected {count}"
        time.sleep(0.01)


def _stage0_held_by_its_first_frame(stage: Stage) -> tuple[StageWorker, Frames, threading.Event]:
    """Stage 0 whose first downstream send waits for ``release``: what arrives meanwhile queues."""
    worker = StageWorker(stage, is_first=True, is_last=False, context_length=1024)
    frames: Frames = []
    release = threading.Event()

    def send(
        rows: list[Row], hidden: torch.Tensor, ids: torch.Tensor, signed: object = None
    ) -> None:
        frames.append((list(rows), hidden.clone()))
        if len(frames) == 1:
            assert release.wait(30)

    worker.links.downstream = send
    return worker, frames, release


def test_returned_tokens_run_as_micro_batches_of_one_over_s(tmp_path: Path) -> None:
    stage = _stages(tmp_path)[0]
    worker = StageWorker(stage, is_first=True, is_last=False)
    worker.micro_batches = 3  # a 3-stage pipeline
    frames: Frames = []
    worker.links.downstream = lambda rows, hidden, ids, signed=None: frames.append(
        (list(rows), hidden.clone())
    )
    prompts = [[5 + r, 9, 11 + 2 * r] for r in range(SEQUENCES)]
    for request, prompt in enumerate(prompts):
        _open(worker, request, prompt)
        _wait_for(frames, request + 1)  # one at a time: each prompt is its own frame
    assert [len(rows) for rows, _ in frames] == [1] * SEQUENCES
    returned = []
    for request, prompt in enumerate(prompts):
        before = prefix_hash(EMPTY_HASH, prompt)
        returned.append(
            TokenRow(
                request, len(prompt), 40 + request, before, prefix_hash(before, [40 + request])
            )
        )
    worker.tokens(TokenFrame(tuple(returned)))
    _wait_for(frames, SEQUENCES + 3)
    time.sleep(0.2)
    batches = frames[SEQUENCES:]
    assert [len(rows) for rows, _ in batches] == [2, 2, 2]  # 6 running sequences over 3 stages
    assert sorted(row.request for rows, _ in batches for row in rows) == list(range(SEQUENCES))
    for rows, hidden in batches:  # each batched row equals that sequence's step alone
        for i, row in enumerate(rows):
            alone = stage(
                torch.tensor(prompts[row.request] + [40 + row.request]), 0, stage.new_cache()
            )
            torch.testing.assert_close(hidden[i], alone[-1], atol=1e-5, rtol=0)


def test_rows_back_early_wait_to_join_a_frame_while_s_frames_are_in_flight(tmp_path: Path) -> None:
    """Two stages, four streams, their tokens coming back in three returns: the rows back first
    wait for the next return and go with it, as two frames of two; never a frame of one."""
    stage = _stages(tmp_path)[0]
    worker = StageWorker(stage, is_first=True, is_last=False)
    worker.micro_batches = 2
    frames: Frames = []
    worker.links.downstream = lambda rows, hidden, ids, signed=None: frames.append(
        (list(rows), hidden.clone())
    )
    prompts = [[5 + r, 9, 11 + 2 * r] for r in range(4)]
    for request, prompt in enumerate(prompts):
        _open(worker, request, prompt)
        _wait_for(frames, request + 1)  # a prompt alone runs at once, whatever is in flight

    def back(*requests: int) -> None:
        rows = []
        for request in requests:
            before = prefix_hash(EMPTY_HASH, prompts[request])
            rows.append(
                TokenRow(request, 3, 40 + request, before, prefix_hash(before, [40 + request]))
            )
        worker.tokens(TokenFrame(tuple(rows)))

    back(0, 1)  # the frames of prompts 2 and 3 are still in flight: 0 and 1 wait
    time.sleep(0.3)
    assert len(frames) == 4
    back(2)  # one frame in flight: 0 and 1 go (at most half the running rows), 2 waits
    _wait_for(frames, 5)
    back(3)
    _wait_for(frames, 6)
    time.sleep(0.2)
    assert [sorted(row.request for row in rows) for rows, _ in frames[4:]] == [[0, 1], [2, 3]]


def test_prompts_that_arrive_together_share_forwards_in_chunks(tmp_path: Path) -> None:
    """Prompts queued while stage 0 is busy run as one batch (chunked prefill): their rows in
    arrival order, within MAX_STEP_TOKENS rows a batch; a prompt longer than what is left goes
    on in the next batch; each row equals its prompt run alone; a request closed while it
    waited is never prefilled."""
    stage = _stages(tmp_path)[0]
    worker, frames, release = _stage0_held_by_its_first_frame(stage)
    _open(worker, 0, [3, 4])
    _wait_for(frames, 1)  # stage 0 is busy sending it
    long = [(7 * i) % 50 + 1 for i in range(MAX_STEP_TOKENS)]
    prompts = {r: [5 + r, 9, 11 + 2 * r] for r in range(1, SEQUENCES)} | {SEQUENCES: long}
    for request, prompt in prompts.items():
        _open(worker, request, prompt)
    worker.close(Close(request=2))  # abandoned while queued
    release.set()
    _wait_for(frames, 3)
    first, second = frames[1][0], frames[2][0]
    short = [r for r in range(1, SEQUENCES) if r != 2]
    assert [row.request for row in first] == short + [SEQUENCES]
    assert sum(row.count for row in first) == MAX_STEP_TOKENS
    assert all(row.flags == RowFlag.FIRST | RowFlag.SAMPLE for row in first[:-1])
    assert first[-1].flags == RowFlag.FIRST and first[-1].count == MAX_STEP_TOKENS - 3 * len(short)
    assert [(row.request, row.position, row.count, row.flags) for row in second] == [
        (SEQUENCES, first[-1].count, 3 * len(short), RowFlag.SAMPLE)
    ]
    for rows, hidden in frames[1:3]:
        offset = 0
        for row in rows:
            alone = stage(torch.tensor(prompts[row.request]), 0, stage.new_cache())
            got = hidden[offset : offset + row.count]
            torch.testing.assert_close(
                got, alone[row.position : row.position + row.count], atol=1e-5, rtol=0
            )
            offset += row.count


def test_a_prompt_in_chunks_runs_as_the_whole_prompt(tmp_path: Path) -> None:
    """The coordinator sends a long prompt in chunks (one control frame could not hold a prompt
    near a long context): stage 0 runs it only once the last chunk is in, as if sent whole; a
    prompt whose chunks pass the context fails its request alone."""
    from seamline.net.frames import LIMITS, FrameType
    from seamline.net.messages import PROMPT_CHUNK_TOKENS, encode_message

    big = Prompt.chunks(7, [129279] * 163840)  # DeepSeek's largest ids at its 160k context
    assert len(big) == 5 and [c.more for c in big] == [True] * 4 + [False]
    assert max(len(encode_message(c)) for c in big) < LIMITS[FrameType.CONTROL] // 2
    assert sum((c.tokens for c in big), ()) == (129279,) * 163840
    stage = _stages(tmp_path)[0]
    worker = StageWorker(stage, is_first=True, is_last=False, context_length=1024)
    frames: Frames = []
    worker.links.downstream = lambda rows, hidden, ids, signed=None: frames.append(
        (list(rows), hidden.clone())
    )
    failed: list[tuple[list[int], Exception]] = []
    worker.links.failed = lambda requests, exc: failed.append((requests, exc))
    prompt = [(5 * i) % 60 + 1 for i in range(40)]
    worker.open(
        Open(request=1, sampling=SamplingParams(max_tokens=8), prompt_len=40, context_length=1024)
    )
    for start, more in ((0, True), (15, True), (30, False)):
        worker.prompt(Prompt(request=1, tokens=tuple(prompt[start : start + 15]), more=more))
        time.sleep(0.05 if more else 0)
        assert not frames or not more  # nothing runs before the last chunk
    _wait_for(frames, 1)
    assert [(row.position, row.count) for row in frames[0][0]] == [(0, 40)]
    torch.testing.assert_close(
        frames[0][1], stage(torch.tensor(prompt), 0, stage.new_cache()), atol=1e-5, rtol=0
    )
    worker.open(
        Open(request=2, sampling=SamplingParams(max_tokens=8), prompt_len=2048, context_length=1024)
    )
    for _ in range(2):
        worker.prompt(Prompt(request=2, tokens=(3,) * min(PROMPT_CHUNK_TOKENS, 1024), more=True))
    assert [requests for requests, _ in failed] == [[2]] and "context" in str(failed[0][1])


class TwoStages:
    """Stage 0 and a last stage wired in one process as a mesh wires them over sockets."""

    def __init__(self, first: Stage, second: Stage, kv_budget_bytes: int | None = None) -> None:
        self.stage0 = StageWorker(
            first, is_first=True, is_last=False, context_length=512, kv_budget_bytes=kv_budget_bytes
        )
        self.stage1 = StageWorker(second, is_first=False, is_last=True)
        self.results: dict[int, list[int]] = {}
        self.rows: list[Row] = []  # every row stage 1 ran
        self.frames: list[list[Row]] = []  # and the frames they came in
        self.finished = threading.Semaphore(0)
        self.stage0.links.downstream = self._hidden
        self.stage0.links.downstream_message = self._message
        self.stage1.links.stage0 = lambda rows: self.stage0.tokens(TokenFrame(tuple(rows)))
        self.stage1.links.results = self._collect

    def _hidden(
        self, rows: list[Row], hidden: torch.Tensor, ids: torch.Tensor, signed: object = None
    ) -> None:
        self.rows += rows
        self.frames.append(list(rows))
        self.stage1.hidden(HiddenFrame(tuple(rows), hidden, ids))

    def _message(self, msg: Message) -> None:
        if isinstance(msg, Open):
            self.stage1.open(msg)
        elif isinstance(msg, Close):
            self.stage1.close(msg)
        else:
            self.stage1.lifetime(msg)  # type: ignore[arg-type]

    def _collect(self, rows: list[TokenRow]) -> None:
        collect(rows, self.results, self.finished)

    def generate(self, requests: dict[int, tuple[list[int], SamplingParams]]) -> None:
        """Send every request at once and wait for all to finish; close them as a coordinator does."""
        for request, (prompt, params) in requests.items():
            _open(self.stage0, request, prompt, params)
        for _ in requests:
            assert self.finished.acquire(timeout=60)
        for request in requests:
            self.stage0.close(Close(request=request))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_a_full_kv_budget_preempts_across_stages_without_changing_any_token(
    temperature: float, tmp_path: Path
) -> None:
    """Two stages wired in one process, stage 0 with a KV budget that holds every prompt's first
    buffer (256 positions) but not every cache grown past it: stage 0 preempts, the sequence
    starts over at position 0 on both stages, and every sequence's tokens equal its run on the
    whole model alone."""
    first, second = _stages(tmp_path)
    new_tokens = 24  # each cache grows past 256 positions, to its prompt + max_tokens
    prompts = [[(5 * r + 3 * i) % 200 + 3 for i in range(238 + 4 * r)] for r in range(4)]
    per_token = kv_bytes_per_token(first.config, 4) * len(first.layers)  # float32, stage 0's layers
    budget = (4 * 256 + new_tokens) * per_token  # every first buffer, one cache grown
    mesh = TwoStages(first, second, budget)
    params = [
        SamplingParams(temperature=temperature, seed=r, max_tokens=new_tokens)
        for r in range(len(prompts))
    ]
    mesh.generate({r: (prompt, p) for r, (prompt, p) in enumerate(zip(prompts, params))})
    assert mesh.stage0.head is not None and mesh.stage0.head.scheduler.preemptions > 0
    assert mesh.stage1.refused == 0 and mesh.stage0.refused == 0
    engine = Engine(load_stage(open_source(tmp_path)), 512)
    for request, (prompt, p) in enumerate(zip(prompts, params)):
        assert mesh.results[request] == list(engine.generate(prompt, p)), request


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_a_request_resumed_with_the_tokens_it_drew_goes_on_as_the_uninterrupted_run(
    temperature: float, tmp_path: Path
) -> None:
    """How a mesh replays a request on a new route: its Open says the prompt's length and its
    chunks carry the tokens drawn before too. Stage 0 resumes it as it resumes a preempted
    sequence (those tokens recomputed, none drawn again, max_tokens counted from the prompt),
    and the rest equals the run that was not interrupted, with the same finish."""
    first, second = _stages(tmp_path)
    prompt = [(7 * i) % 200 + 3 for i in range(40)]
    params = SamplingParams(temperature=temperature, seed=11, max_tokens=12)
    whole = list(Engine(load_stage(open_source(tmp_path)), 512).generate(prompt, params))
    mesh = TwoStages(first, second)
    mesh.stage0.open(Open(request=1, sampling=params, prompt_len=len(prompt), context_length=512))
    mesh.stage0.prompt(Prompt(request=1, tokens=tuple(prompt + whole[:5])))
    assert mesh.finished.acquire(timeout=60)
    assert mesh.results[1] == whole[5:] and len(whole) == 12
    drawn = [row.position for row in mesh.rows if row.flags & RowFlag.SAMPLE]
    assert (
        drawn[0] == len(prompt) + 4
    )  # the first draw is the sixth token's: none of the five again


def test_prompts_that_begin_alike_share_the_prefix_on_every_stage(tmp_path: Path) -> None:
    """With prefix sharing on, a request whose prompt begins as a finished one's, and two
    identical prompts at once, start from a copy of that cache on both stages (Fork): stage 1
    runs only their new positions, and their tokens equal the whole model's alone. Stage 1
    holds exactly the caches stage 0 keeps: stage 0 keeps room for one finished request here,
    and each it drops (Forget) is freed on stage 1 too."""
    first, second = _stages(tmp_path)
    mesh = TwoStages(first, second)
    head = mesh.stage0.head
    assert head is not None
    head.share_prefixes(True)
    system = [(11 * i) % 200 + 3 for i in range(30)]
    params = SamplingParams(max_tokens=6)
    # room for one request's cache: its buffers hold its prompt + max_tokens positions (under
    # MIN_CAPACITY), and the bound counts buffers
    positions = len(system) + 3 + params.max_tokens
    head.scheduler.prefix.capacity_bytes = int(1.5 * positions * head.scheduler.kv_bytes_per_token)
    prompts = {0: system + [5, 6], 1: system + [9, 10, 11], 2: system + [7], 3: system + [7]}
    mesh.generate({0: (prompts[0], params)})
    mesh.generate({r: (prompts[r], params) for r in (1, 2, 3)})
    starts = {r: min(row.position for row in mesh.rows if row.request == r) for r in prompts}
    assert starts == {
        0: 0,
        1: len(system),
        2: len(system),
        3: len(system),
    }  # the twin copied the other's prompt
    assert mesh.stage0.refused == 0 and mesh.stage1.refused == 0
    engine = Engine(load_stage(open_source(tmp_path)), 512)
    for request, prompt in prompts.items():
        assert mesh.results[request] == list(engine.generate(prompt, params)), request
    deadline = time.monotonic() + 10
    while len(mesh.stage1.sequences) != 1:  # the one kept; the closes reach stage 1 as Forget
        assert time.monotonic() < deadline, mesh.stage1.sequences
        time.sleep(0.01)
    assert set(mesh.stage1.sequences) == {request for _, request in head._held.values()}


def test_a_private_last_stage_opened_before_stage_0_has_the_prompt_draws_as_the_whole_model(
    tmp_path: Path,
) -> None:
    """A private mesh's ends (``pair``): stage 0 passes each Open on before its prompt has come,
    so the last stage opens the request before stage 0 knows how it draws (here every time: the
    Open reaches stage 1 at once). The first frame settles it, and the tokens are the whole
    model's with the request's own parameters, none refused."""
    first, second = _stages(tmp_path)
    mesh = TwoStages(first, second)
    pair(mesh.stage0, mesh.stage1)
    prompts = {r: [(7 * r + 5 * i) % 200 + 3 for i in range(5 + 3 * r)] for r in range(3)}
    params = {
        r: SamplingParams(temperature=0.8 * r, seed=r, max_tokens=6, presence_penalty=0.5 * r)
        for r in prompts
    }
    mesh.generate({r: (prompt, params[r]) for r, prompt in prompts.items()})
    assert mesh.stage0.refused == 0 and mesh.stage1.refused == 0
    engine = Engine(load_stage(open_source(tmp_path)), 512)
    for request, prompt in prompts.items():
        assert mesh.results[request] == list(engine.generate(prompt, params[request])), request


@pytest.mark.parametrize("kind", ["dense", "mixtral", "deepseek_v3", "embedded"])
def test_staggered_sequences_on_two_stages_equal_each_alone(kind: str, tmp_path: Path) -> None:
    """Eight sequences of 5-40 prompt tokens join a two-stage pipeline as earlier ones decode
    (the i-th when ARRIVALS[i] tokens have come back in all): prompts are prefilled in chunks
    beside decode rows, and each sequence's greedy tokens equal its run alone on the whole
    model, the logits of each draw within 1e-4 (float32)."""
    source = checkpoint_source(kind, tmp_path)
    whole = load_stage(source)
    middle = whole.config.num_layers // 2
    mesh = TwoStages(
        load_stage(source, Ownership(layers=(0, middle))),
        load_stage(source, Ownership(layers=(middle, whole.config.num_layers))),
    )
    drawn: dict[tuple[int, int], torch.Tensor] = {}  # (request, position) -> logits of that draw
    sample = mesh.stage1._sample

    def recorded(w: Work, logits: torch.Tensor) -> TokenRow:
        drawn[(w.row.request, w.row.position + w.row.count)] = logits.float().clone()
        return sample(w, logits)

    mesh.stage1._sample = recorded  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(7)
    vocab = min(whole.config.vocab_size, 256)
    prompts = [
        torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 40, 12, 33, 7, 21, 9, 28)
    ]
    arrivals = (0, 0, 3, 6, 9, 15, 24, 39)  # tokens returned in all before each joins
    params = SamplingParams(max_tokens=12)
    for request, (prompt, arrival) in enumerate(zip(prompts, arrivals)):
        deadline = time.monotonic() + 60
        while sum(len(t) for t in mesh.results.values()) < arrival:
            assert time.monotonic() < deadline, mesh.results
            time.sleep(0.002)
        _open(mesh.stage0, request, prompt, params)
    for _ in prompts:
        assert mesh.finished.acquire(timeout=120)
    assert max(len(rows) for rows in mesh.frames) > 1  # rows of several sequences shared frames
    engine = Engine(whole, 512)
    for request, prompt in enumerate(prompts):
        alone = list(engine.generate(prompt, params))
        assert mesh.results[request] == alone, request
        cache = whole.new_cache()
        expected = [whole(torch.tensor(prompt), 0, cache, last_only=True)[-1]]
        for i, token in enumerate(alone[:-1]):
            expected.append(whole(torch.tensor([token]), len(prompt) + i, cache)[-1])
        got = torch.stack([drawn[(request, len(prompt) + i)] for i in range(len(alone))])
        err = (got - torch.stack(expected).float()).abs().max().item()
        assert err <= 1e-4, f"request {request}: max |pipeline - alone| = {err:.2e}"
