"""PipelineHead: stage 0's runtime, the scheduler driving a pipeline whose head is further on.

Requests arrive as an ``Open`` (how to sample) and a ``Prompt`` (the tokens) and join the
``Scheduler`` as on one process: FCFS admission under ``max_running`` and the KV budget,
decode rows and chunks of several prompts in one batch (chunked prefill), preemption when
the budget fills (the sequence starts over at position 0, which tells every later stage to
reset its cache for it), and a request closed while it waits is never prefilled.

One driver thread owns the scheduler; the threads that read links only leave prompts, closes
and returned tokens in its inbox. Each batch runs stage 0's layers and goes downstream as one
frame. A row after which the last stage draws leaves its sequence in flight until the token
comes back, and a batch takes at most 1/S of the running sequences' decode rows with S
micro-batches (one per stage unless the route asks for more): while stage 1 runs one, stage 0
runs the next. While S frames that draw are in flight and nothing but decode rows is ready,
stage 0 waits for one to come back: rows that came back early join it, rather than leave as a
small frame of their own, which would stay one (a frame's rows come back together) and cost
every stage a step's fixed cost (simulated: 64 streams on two stages could settle into three
frames of about 21 rows instead of two of 32).

Stage 0 decides every cache's lifetime on every stage, in order with the frames: a sequence
that begins as a running or recently finished one (a system prompt, a chat's earlier turns)
starts from a copy of that cache's common positions, and ``Fork`` tells the later stages to
make the same copy; ``Forget`` frees a cache there when stage 0 frees it (a finished cache may
be kept a while for prompts that begin alike). Prefixes are shared when every stage can copy
a cache (``share_prefixes``: no lockstep group in the pipeline).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from seamline.config import RING_SLACK
from seamline.errors import RequestError
from seamline.net.frames import EMPTY_HASH, Row, RowFlag, TokenRow, asking_drafts, prefix_hash
from seamline.net.messages import Close, Forget, Fork, Message, Open
from seamline.runtime.core import EngineCore
from seamline.runtime.prefix_cache import PREFIX_CACHE_BYTES
from seamline.runtime.scheduler import Batch, Emission, Scheduler, SequenceState, check_prompt
from seamline.runtime.speculation import Speculation
from seamline.runtime.stage_rows import Drawing, OutOfStep, Work, token_event
from seamline.runtime.step_clock import RingClock

if TYPE_CHECKING:
    from seamline.runtime.stage_worker import StageWorker

log = logging.getLogger("seamline.stage")
MAX_STEP_TOKENS = 512  # rows in one batch: decode rows and prompt chunks together
# A prompt's chunks per stage in a pipeline of S > 1 stages, for a prompt of MAX_STEP_TOKENS:
# its chunks flow through the stages, stage 1 computing chunk k while stage 0 computes k + 1.
# With k chunks a prompt takes (k + S - 1) chunks' time instead of S whole prompts'; each
# chunk costs a forward and a frame. Measured (`bench split`'s V4 rows, two stages on 1 GbE,
# a 512-token prompt): whole prompts 0.84x one node's speed, chunks of 128 rows 1.11x.
PIPELINE_CHUNKS_PER_STAGE = 2
MIN_PIPELINE_CHUNK = 32  # rows: below, a chunk's forward and frame cost more than they save
MAX_RUNNING = 256  # sequences holding a cache at once
MAX_WAITING = 1024  # the coordinator bounds what it sends; this only guards a runaway peer


@dataclass
class Inbox:
    prompts: list[tuple[int, list[int]]] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)
    returned: list[TokenRow] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prompts or self.closed or self.returned)


class PipelineHead:
    def __init__(
        self, worker: StageWorker, context_length: int, kv_budget_bytes: int | None = None
    ) -> None:
        self.worker = worker
        self.scheduler = Scheduler(
            worker.stage,
            context_length,
            max_step_tokens=MAX_STEP_TOKENS,
            max_running=MAX_RUNNING,
            kv_budget_bytes=kv_budget_bytes,
            max_waiting=MAX_WAITING,
            forks=False,
        )
        self._opened: dict[int, Open] = {}  # opened, prompt not yet here
        self._partial: dict[
            int, list[int] | None
        ] = {}  # prompts whose last chunk has not come (None: refused)
        self._sequences: dict[
            int, SequenceState
        ] = {}  # by request id: each holds its wire state too
        self._held: dict[
            int, tuple[object, int]
        ] = {}  # id(cache) -> (cache, request it has downstream)
        # id(cache) of caches the scheduler freed that later stages keep until every sequence forked
        # from them has told the later stages (a kept prefix evicted between a fork and its first rows)
        self._forget_later: set[int] = set()
        self._steps = 0  # batches run: a frame's number (``SequenceState.frame``)
        self.scheduler.on_free = self._freed
        self.core = EngineCore(self.scheduler, self)  # this head is the pipeline's executor
        self._model_drafts = False  # the last stage drafts with its MTP layer (``speculate``)
        self.ring = RingClock()  # one stream's row from leaving stage 0 to its token coming back
        self._inbox = Inbox()
        self.hash_key: bytes | None = (
            None  # rows' prefix hashes keyed (a private mesh: members read no token from them)
        )
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    # -- from the link readers (any thread) ----------------------------------------------
    def open(self, msg: Open) -> None:
        with self._cond:
            self._opened[msg.request] = msg

    def prompt(self, request: int, tokens: list[int], more: bool = False) -> None:
        """A chunk of ``request``'s prompt; the whole prompt joins the scheduler with its last
        chunk. A prompt longer than the context fails its request alone."""
        with self._cond:
            before = self._partial.pop(request, [])
            if before is None:  # refused already: its other chunks are dropped
                if more:
                    self._partial[request] = None
                return
            whole = before + tokens
            if more:
                fits = len(whole) < self.scheduler.context_length
                self._partial[request] = whole if fits else None
                if fits:
                    return
        if more:
            self._fail(
                [request],
                RequestError(
                    f"request {request}'s prompt exceeds the context of "
                    f"{self.scheduler.context_length} tokens"
                ),
            )
            return
        self._post(lambda inbox: inbox.prompts.append((request, whole)))

    def close(self, request: int) -> None:
        with self._cond:
            self._partial.pop(request, None)
        self._post(lambda inbox: inbox.closed.append(request))

    def output(self, request: int, drawing: Drawing) -> list[int]:
        """The tokens the request generated so far (a resumed one's include those before it)."""
        sequence = self._sequences.get(request)
        return [] if sequence is None else list(sequence.tokens)

    def drawing(self, request: int) -> Drawing | None:
        """How ``request`` draws (its params, seed and where its output began), while it is open
        here: a last stage in this process draws with it (a private mesh's). None before its
        prompt has come whole (no frame of it has left this stage then)."""
        sequence = self._sequences.get(request)
        return None if sequence is None else self._drawing(sequence)

    def _drawing(self, sequence: SequenceState) -> Drawing:
        return Drawing(
            sequence.params, sequence.seed, len(sequence.prompt), self.scheduler.context_length
        )

    def returned(self, rows: list[TokenRow]) -> None:
        if len(rows) == 1:
            self.ring.returned()
        self._post(lambda inbox: inbox.returned.extend(rows))

    def share_prefixes(self, on: bool) -> None:
        """Set before any request: whether new sequences may start from copies of others' caches."""
        on = on and self.worker.stage.forks_caches
        self.scheduler.forks = on
        self.scheduler.prefix.capacity_bytes = PREFIX_CACHE_BYTES if on else 0

    def speculate(self, speculation: Speculation | None) -> None:
        """Set before any request: whether stage 0 drafts windows for the later stages to verify
        (``mtp``: the last stage's multi-token-prediction layer drafts; rows ask it how many)."""
        self.scheduler.speculate(speculation)
        self._model_drafts = (
            self.scheduler.speculation is not None and self.scheduler.speculation.mode == "mtp"
        )

    def caches(self) -> tuple[list[Any], list[Any]]:
        """The running sequences' caches, and the finished ones kept for prompts that begin alike."""
        running = [s.cache for s in list(self.scheduler.running) if s.cache is not None]
        return running, self.scheduler.prefix.caches()

    def stop(self) -> None:
        """A new plan replaced this stage: the driver thread ends and lets go of every cache."""
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _post(self, put: Any) -> None:
        with self._cond:
            if self._stopped:
                return
            put(self._inbox)
            self.worker.idle.work()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._drive, name="seamline-stage0", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    # -- the driver thread -----------------------------------------------------------------
    def _drive(self) -> None:
        busy = False
        while True:
            with self._cond:
                while not busy and not self._inbox and not self._stopped:
                    self.worker.idle.wait()
                    self._cond.wait()
                if self._stopped:  # nothing refers to this stage after the thread ends: it is freed
                    return
                inbox, self._inbox = self._inbox, Inbox()
            try:
                self.worker.clock.begin(
                    counted=not (inbox.prompts or inbox.closed)
                )  # a request's start or end
                self._take(inbox)
                busy = self._run_next()
                self.worker.clock.end()
            except Exception:  # a link gone mid-send: the coordinator hears of it; stage 0 goes on
                log.exception("stage 0's driver")
                busy = False

    def _take(self, inbox: Inbox) -> None:
        """Returned tokens first: a close that came with them was sent after they were drawn."""
        self._accept(inbox.returned)
        for request, tokens in inbox.prompts:
            self._add(request, tokens)
        for request in inbox.closed:
            self._cancel(request)

    def _add(self, request: int, tokens: list[int]) -> None:
        with self._cond:
            opened = self._opened.pop(request, None)
        try:
            if opened is None:
                raise OutOfStep(f"request {request} is not open on this stage")
            opened.sampling.validate()  # as the wire brought them: the request enters the engine here
            check_prompt(tokens, self.scheduler.context_length)
            if not 0 < opened.prompt_len <= len(tokens):
                raise RequestError(
                    f"request {request} opened with a prompt of {opened.prompt_len} tokens "
                    f"and sent {len(tokens)}"
                )
            # tokens past the prompt were drawn on an earlier route: resumed as a preempted sequence is
            prompt, drawn = tokens[: opened.prompt_len], tokens[opened.prompt_len :]
            sequence = self.scheduler.add(prompt, opened.sampling, drawn)
        except Exception as exc:  # this request ends alone
            self._fail([request], exc)
            return
        sequence.request = request
        self._sequences[request] = sequence

    def _cancel(self, request: int) -> None:
        with self._cond:
            self._opened.pop(request, None)
        sequence = self._sequences.get(request)
        if sequence is not None:  # a row still in flight may have been refused downstream
            self._drop(sequence, reached_downstream=not sequence.in_flight)
        self._send(Close(request=request))
        if all(held != request for _, held in self._held.values()):
            self._send(Forget(request=request))  # opened downstream, and no cache of it kept here

    def _drop(self, sequence: SequenceState, reached_downstream: bool = True) -> None:
        """Cancel a sequence; a cache whose rows did not all reach the later stages (none yet,
        or a failed batch's) is not kept for prefixes, since they do not hold it."""
        if not reached_downstream or sequence.announced is not sequence.cache:
            sequence.cached = 0
        self.scheduler.cancel(sequence)
        self._forget(sequence)

    def _forget(self, sequence: SequenceState) -> None:
        assert sequence.request is not None
        del self._sequences[sequence.request]
        sequence.in_flight, sequence.announced = False, None

    def _freed(self, cache: object, for_good: bool) -> None:
        """The scheduler freed a cache: free it downstream too, unless its sequence was preempted
        (it starts over at position 0 or from a fork, which resets it there), and not before the
        sequences forked from it have forked downstream too."""
        if for_good and id(cache) in self._held and self._awaited(cache):
            self._forget_later.add(id(cache))
            return
        entry = self._held.pop(id(cache), None)
        if entry is not None and for_good:
            self._send(Forget(request=entry[1]))

    def _awaited(self, cache: object) -> bool:
        """Whether a sequence forked from ``cache`` has not yet told the later stages."""
        return any(
            s.donor is cache and s.announced is not s.cache for s in self._sequences.values()
        )

    def _forget_released(self) -> None:
        for key in [k for k in self._forget_later if not self._awaited(self._held[k][0])]:
            self._forget_later.discard(key)
            self._send(Forget(request=self._held.pop(key)[1]))

    def _announce(self, sequence: SequenceState, start: int) -> None:
        """A sequence's first rows since it got its cache: downstream starts from the same fork."""
        assert sequence.request is not None
        if sequence.announced is not None:
            self._held.pop(id(sequence.announced), None)
        sequence.announced = sequence.cache
        self._held[id(sequence.cache)] = (sequence.cache, sequence.request)
        if sequence.donor is None:
            return  # it starts at position 0: its first row resets the later stages
        if (
            id(sequence.donor) not in self._held
        ):  # a sequence admitted with it that has run no row yet
            first = next(s for s in self._sequences.values() if s.cache is sequence.donor)
            self._announce(first, first.cached)
        donor = self._held[id(sequence.donor)]
        assert donor[0] is sequence.donor
        sequence.prefix_hash = prefix_hash(EMPTY_HASH, sequence.known(0, start), self.hash_key)
        self._send(
            Fork(
                request=sequence.request, donor=donor[1], positions=start, hash=sequence.prefix_hash
            )
        )

    def _send(self, message: Message) -> None:
        if self.worker.links.downstream_message is not None:
            self.worker.links.downstream_message(message)

    def _accept(self, rows: list[TokenRow]) -> None:
        """Tokens drawn downstream: each must be the one its sequence is waiting for. A window's
        draws come one after another; it stays in flight until the draw that closes it."""
        for row in rows:
            sequence = self._sequences.get(row.request)
            try:
                if sequence is None or not sequence.in_flight:
                    raise OutOfStep(f"request {row.request} is not waiting for a token here")
                expected = len(sequence.prompt) + len(sequence.tokens)
                if row.position != expected or row.hash_before != self._hash_before(
                    sequence, expected
                ):
                    raise OutOfStep(
                        f"request {row.request}: token for position {row.position}, stage 0 is at {expected}"
                    )
            except OutOfStep as exc:
                self.worker.refuse(row.request, "token", exc)
                continue
            windowed = _window_open(sequence)
            if self.scheduler.record(sequence, token_event(row)).sequence.finished:
                self._forget(sequence)
            elif not _window_open(sequence):
                sequence.in_flight = False
                if (
                    row.drafts and sequence.drafter is not None
                ):  # the last stage's, for the next window
                    sequence.drafter.offered = list(row.drafts)
                if windowed:  # the positions computed are the last token and the drafts accepted
                    sequence.prefix_hash = self._hash_before(sequence, sequence.cached)

    def _hash_before(self, sequence: SequenceState, position: int) -> int:
        """The prefix hash through ``position - 1``: inside an open window, from its start's."""
        if not _window_open(sequence) and position == len(sequence.prompt) + len(sequence.tokens):
            return sequence.prefix_hash
        return prefix_hash(
            sequence.window_hash, sequence.known(sequence.window_start + 1, position), self.hash_key
        )

    def _run_next(self) -> bool:
        """The engine core's step over the sequences with no token in flight; False when there
        was nothing to run."""
        if self._forget_later:
            self._forget_released()
        if self._frames_full():
            return False
        cap = max(1, -(-len(self.scheduler.running) // max(1, self.worker.micro_batches)))
        self.scheduler.prefill_chunk = pipeline_prefill_chunk(self.worker.stages)
        return self.core.step(ready=self._ready, max_decode_rows=cap) is not None

    def _frames_full(self) -> bool:
        """Whether as many frames that draw are in flight as the pipeline has micro-batches and
        nothing is ready but decode rows: the next step waits for a frame to come back."""
        if self.worker.is_last or self.scheduler.waiting:
            return False
        running = self.scheduler.running
        frames = {s.frame for s in running if s.in_flight}
        if len(frames) < self.worker.micro_batches:
            return False
        return not any((s.prefilling or _window_open(s)) and self._ready(s) for s in running)

    def _ready(self, sequence: SequenceState) -> bool:
        """Whether ``sequence`` takes rows in the next step: none of its tokens is being drawn
        downstream, or its window is and another may follow it: fewer windows than the
        pipeline's stages are in flight, and the last one was accepted whole or the pipeline has
        stages to spare (fewer sequences than stages: a window that turns out stale costs the
        stages only time they would have waited, and the last stage skips it)."""
        if not sequence.in_flight:
            return True
        drafter = sequence.drafter
        if drafter is None or not drafter.window or drafter.in_flight >= self.worker.micro_batches:
            return False
        if (
            self.worker.stage.config.sliding_window
            and drafter.pending + drafter.wanted() > RING_SLACK
        ):
            return False  # a rejection would go back past what the model's sliding layers keep
        return drafter.full or len(self.scheduler.running) < self.worker.micro_batches

    def run(self, batch: Batch) -> list[Emission]:
        """The pipeline's executor: the batch runs stage 0's layers and goes downstream as one
        frame; its tokens are recorded as the last stage returns them (``_accept``: at once
        when stage 0 is the last stage too), so it gives back none itself."""
        self._steps += 1
        work = self._rows(batch)
        try:
            looped = self.worker.run_batch(work)
        except Exception as exc:  # the batch's requests fail; stage 0 keeps serving
            log.exception("a stage-0 batch failed")
            for sequence in batch.owners:
                self._drop(sequence, reached_downstream=False)
            self._fail([w.row.request for w in work], exc)
            return []
        one_row = len(work) == 1 and work[0].row.count == 1 and not self.worker.is_last
        self.ring.sent(one_row and len(self.scheduler.running) == 1)
        self._accept(looped)
        return []

    def _rows(self, batch: Batch) -> list[Work]:
        """The batch's rows with their prefix hashes; the rows that draw put their sequence in flight."""
        work = []
        for sequence, span, draws, follow in zip(
            batch.owners, batch.spans, batch.draws, batch.follows
        ):
            assert sequence.request is not None
            if sequence.announced is not sequence.cache:
                self._announce(sequence, span.start)
            ids = batch.inputs[span.offset : span.offset + span.count]
            before = EMPTY_HASH if span.start == 0 else sequence.prefix_hash
            sequence.prefix_hash = after = prefix_hash(before, ids, self.hash_key)
            flags = (RowFlag.FIRST if span.start == 0 else RowFlag.NONE) | (
                RowFlag.SAMPLE if draws else RowFlag.NONE
            )
            if follow:  # drafts going on from the window in flight: its draws are checked from that window's start
                flags |= RowFlag.WINDOW | RowFlag.FOLLOW
            elif (
                span.rowwise
            ):  # a window: its draws are checked from the hash through its first position
                sequence.window_start, sequence.window_hash = (
                    span.start,
                    prefix_hash(before, ids[:1], self.hash_key),
                )
                flags |= RowFlag.WINDOW
            if draws:
                sequence.in_flight, sequence.frame = True, self._steps
            if (
                draws and self._model_drafts and sequence.drafter is not None
            ):  # the last stage's MTP layer drafts
                flags = asking_drafts(int(flags), sequence.drafter.wanted())
            row = Row(sequence.request, span.start, span.count, before, after, int(flags))
            work.append(
                Work(row, span.cache, torch.tensor(ids, dtype=torch.long), self._drawing(sequence))
            )
        return work

    def _fail(self, requests: list[int], exc: Exception) -> None:
        if self.worker.links.failed is not None:
            self.worker.links.failed(requests, exc)
        else:
            log.warning("requests %s failed: %s", requests, exc)


def pipeline_prefill_chunk(stages: int) -> int | None:
    """The most rows of one prompt in a step of stage 0 in a pipeline of ``stages`` (None: one
    stage, whose prompts take whole steps): a chunk that leaves stage 0 goes on through the
    later stages while stage 0 computes the next (a chunk that draws nothing leaves its
    sequence ready for the next step)."""
    if stages <= 1:
        return None
    return max(MIN_PIPELINE_CHUNK, MAX_STEP_TOKENS // (PIPELINE_CHUNKS_PER_STAGE * stages))


def _window_open(sequence: SequenceState) -> bool:
    return sequence.drafter is not None and bool(sequence.drafter.window)
