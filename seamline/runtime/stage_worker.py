"""StageWorker: one pipeline stage's data path, independent of how its links were made.

Stage 0 embeds prompts and the tokens the last stage sends back; every stage runs its layers
on the hidden-state frames it receives and passes them on; the last stage samples and sends
the token id straight back to stage 0 (and a copy to the coordinator, which streams it to the
client). Every row is checked against the sequence's record — position and prefix hash — so a
frame that is out of step is refused instead of computing garbage.

Rows travel and run together: the rows of one frame are one batched forward
(``Stage.forward_batch``: each weight multiplied once for all of them, attention per
sequence), and the last stage samples every row of it and returns the tokens in one frame.
Stage 0 feeds returned tokens through one driver thread that takes every token waiting, so
concurrent requests merge into shared steps, but at most 1/S of the open sequences per batch
with S stages: at least S micro-batches stay in flight, and while stage 1 runs one, stage 0
runs the next.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from seamline.model.cache import Span
from seamline.model.stage import Stage
from seamline.net.frames import EMPTY_HASH, HiddenFrame, Row, RowFlag, TokenFrame, TokenRow, prefix_hash
from seamline.net.messages import Close, Open, Prompt
from seamline.runtime.sampling import SamplingParams, request_seed, sample

if TYPE_CHECKING:
    from seamline.runtime.group_stage import LockstepStage

log = logging.getLogger("seamline.stage")
PREFILL_CHUNK = 512
SendHidden = Callable[[list[Row], torch.Tensor], None]
SendTokens = Callable[[list[TokenRow]], None]
SendOpen = Callable[[Open], None]
Work = tuple[Row, "Sequence", torch.Tensor]  # a row, its sequence, its inputs (ids or hidden)
RECENTLY_CLOSED = 1024  # late frames of these requests are dropped quietly


class OutOfStep(Exception):
    """A row whose request, position or prefix hash does not match this stage's record."""


@dataclass
class Sequence:
    cache: Any  # SequenceCache, or a lockstep group's GroupCache
    params: SamplingParams
    context_length: int
    next_position: int = 0
    hash: int = EMPTY_HASH
    generated: int = 0
    done: bool = False
    seed: int = 0  # what its draws derive from, with their positions


@dataclass
class StageLinks:
    """Where this stage's output goes; None where the stage has no such neighbour."""

    downstream: SendHidden | None = None  # next stage (hidden frames)
    downstream_open: SendOpen | None = None  # next stage (session create, ahead of its frames)
    stage0: SendTokens | None = None  # last stage -> stage 0 (tokens)
    results: SendTokens | None = None  # last stage -> coordinator (tokens)
    failed: Callable[[list[int], Exception], None] | None = None  # stage 0's batch of these requests failed


class StageWorker:
    def __init__(self, stage: Stage | LockstepStage, is_first: bool, is_last: bool) -> None:
        self.stage = stage
        self.dtype = stage.compute_dtype
        self.is_first = is_first
        self.is_last = is_last
        self.links = StageLinks()
        self.sequences: dict[int, Sequence] = {}
        self.closed: dict[int, None] = {}  # insertion-ordered set of recently closed requests
        self.lock = threading.Lock()
        self.refused = 0
        self.decode_steps = 0  # forwards of decode rows only, and the seconds they took
        self.decode_seconds = 0.0
        self.micro_batches = 1  # the pipeline's stage count (set by the route)
        self._pending: list[TokenRow] = []  # stage 0: returned tokens waiting to be embedded
        self._pending_ready = threading.Condition()
        self._driver: threading.Thread | None = None  # stage 0's thread that embeds them

    # -- session calls (mirrored to every stage by the coordinator) --------------------
    def open(self, msg: Open) -> None:
        """Create the sequence here, then pass the call on down the pipeline: it travels on the
        same link as the request's frames, so it always reaches the next stage before them."""
        s = msg.sampling
        params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                                seed=s.seed, max_tokens=s.max_tokens, stop_token_ids=s.stop_token_ids)  # fmt: skip
        with self.lock:
            seq = Sequence(self.stage.new_cache(params.greedy), params, msg.context_length)
            seq.seed = request_seed(s.seed)
            self.sequences[msg.request] = seq
        if not self.is_last and self.links.downstream_open is not None:
            self.links.downstream_open(msg)

    def holdings(self) -> dict[str, int]:
        """The sequences open here and the KV cache bytes they hold (a lockstep group: this rank's)."""
        with self.lock:
            caches = [seq.cache for seq in self.sequences.values()]
        kv = sum(c.nbytes() for c in caches if hasattr(c, "nbytes"))
        return {"sequences": len(caches), "kv_bytes": kv, "micro_batches": self.micro_batches if self.is_first else 0}

    def close(self, msg: Close) -> None:
        seq = self.sequences.get(msg.request)
        if seq is not None:
            seq.done = True  # seen at once by a single-stage generation loop
        with self.lock:
            seq = self.sequences.pop(msg.request, None)
            self.closed[msg.request] = None
            if len(self.closed) > RECENTLY_CLOSED:
                del self.closed[next(iter(self.closed))]
        if seq is not None:
            self.stage.release_cache(seq.cache)

    # -- data path ----------------------------------------------------------------------
    def prompt(self, msg: Prompt) -> None:
        """Stage 0: run the prompt in chunks and pass each chunk on."""
        looped: list[TokenRow] = []
        with self.lock:
            seq = self._sequence(msg.request)
            tokens = list(msg.tokens)
            for start in range(0, len(tokens), PREFILL_CHUNK):
                chunk = tokens[start : start + PREFILL_CHUNK]
                flags = RowFlag.FIRST if start == 0 else RowFlag.NONE
                if start + len(chunk) == len(tokens):
                    flags |= RowFlag.SAMPLE
                looped = self._run_batch([self._embedding_work(msg.request, seq, chunk, flags)])
        self._feed_back(looped)

    def tokens(self, frame: TokenFrame) -> None:
        """Stage 0: tokens sampled by the last stage come back to be embedded."""
        self._feed_back(list(frame.rows))

    def _feed_back(self, rows: list[TokenRow]) -> None:
        """Stage 0: leave returned tokens (its own, when it is also the last stage) to the
        driver thread, so that the reader that brought them goes back to reading."""
        if not rows:
            return
        with self._pending_ready:
            self._pending += rows
            if self._driver is None:
                self._driver = threading.Thread(target=self._drive, name="seamline-stage0", daemon=True)
                self._driver.start()
            self._pending_ready.notify()

    def _drive(self) -> None:
        """Embed the waiting tokens in batches of at most 1/S of the open sequences."""
        while True:
            with self._pending_ready:
                while not self._pending:
                    self._pending_ready.wait()
                cap = max(1, -(-len(self.sequences) // self.micro_batches))
                rows, self._pending = self._pending[:cap], self._pending[cap:]
            try:
                with self.lock:
                    looped = self._token_rows(rows)
            except Exception as exc:  # the batch's requests fail; stage 0 keeps serving
                log.exception("a stage-0 batch failed")
                if self.links.failed is not None:
                    self.links.failed([row.request for row in rows], exc)
                continue
            if looped:
                with self._pending_ready:
                    self._pending += looped

    def hidden(self, frame: HiddenFrame) -> None:
        """Stages after the first: run our layers on each row and pass it on."""
        expected = (self.stage.config.hidden_size,)
        if tuple(frame.tensor.shape[1:]) != expected or frame.tensor.dtype != self.dtype:
            self.refused += 1
            log.warning("refused frame: tensor %s %s, this stage takes [tokens, %d] %s",
                        frame.tensor.dtype, tuple(frame.tensor.shape), expected[0], self.dtype)  # fmt: skip
            return
        with self.lock:
            work: list[Work] = []
            offset = 0
            for row in frame.rows:
                x = frame.tensor[offset : offset + row.count]
                offset += row.count
                try:
                    seq = self._check_row(row)
                    _check_unique(row.request, work)
                except OutOfStep as exc:
                    self._refuse(row.request, "frame", exc)
                    continue
                work.append((row, seq, x))
            self._run_batch(work)

    # -- internals ----------------------------------------------------------------------
    def _refuse(self, request: int, what: str, exc: OutOfStep) -> None:
        if request in self.closed:
            return  # in flight when the request was closed: expected, not an error
        self.refused += 1
        log.warning("refused %s: %s", what, exc)

    def _sequence(self, request: int) -> Sequence:
        seq = self.sequences.get(request)
        if seq is None:
            raise OutOfStep(f"request {request} is not open on this stage")
        return seq

    def _check_row(self, row: Row) -> Sequence:
        seq = self._sequence(row.request)
        if row.position != seq.next_position or row.hash_before != seq.hash:
            raise OutOfStep(
                f"request {row.request}: frame at position {row.position} (prefix {row.hash_before:016x}) "
                f"but this stage is at {seq.next_position} (prefix {seq.hash:016x})"
            )
        if seq.done:
            raise OutOfStep(f"request {row.request} has already finished")
        return seq

    def _token_rows(self, rows: list[TokenRow]) -> list[TokenRow]:
        """Embed and run every valid returned token as one batch; the tokens to loop back."""
        work: list[Work] = []
        for row in rows:
            try:
                seq = self._sequence(row.request)
                expected_after = prefix_hash(seq.hash, [row.token])
                if row.position != seq.next_position or row.hash_before != seq.hash or row.hash_after != expected_after:
                    raise OutOfStep(f"request {row.request}: token for position {row.position}, stage 0 is at {seq.next_position}")
                _check_unique(row.request, work)
            except OutOfStep as exc:
                self._refuse(row.request, "token", exc)
                continue
            if row.flags & RowFlag.DONE or (seq.done and not self.is_last):
                seq.done = True
                continue
            work.append(self._embedding_work(row.request, seq, [row.token], RowFlag.SAMPLE))
        return self._run_batch(work)

    def _embedding_work(self, request: int, seq: Sequence, tokens: list[int], flags: int) -> Work:
        before = seq.hash
        row = Row(request, seq.next_position, len(tokens), before, prefix_hash(before, tokens), int(flags))
        return row, seq, torch.tensor(tokens, dtype=torch.long)

    def _run_batch(self, work: list[Work]) -> list[TokenRow]:
        """Run our layers on every row at once; pass the rows on as one frame, or sample them.
        Returns the tokens a first-and-last stage loops back."""
        if not work:
            return []
        inputs = work[0][2] if len(work) == 1 else torch.cat([x for _, _, x in work])
        spans, offset = [], 0
        for row, seq, _ in work:
            spans.append(Span(offset, row.count, row.position, seq.cache))
            offset += row.count
        started = time.perf_counter()
        out = self.stage.forward_batch(inputs, spans, last_only=self.is_last)
        if all(row.count == 1 for row, _, _ in work):
            self.decode_steps += 1
            self.decode_seconds += time.perf_counter() - started
        for row, seq, _ in work:
            seq.next_position += row.count
            seq.hash = row.hash_after
        if not self.is_last:
            assert self.links.downstream is not None, "a middle stage needs a downstream link"
            self.links.downstream([row for row, _, _ in work], out)
            return []
        sampled = [self._sample(row, seq, out[i]) for i, (row, seq, _) in enumerate(work) if row.flags & RowFlag.SAMPLE]
        if sampled and not self.is_first and self.links.stage0 is not None:
            self.links.stage0(sampled)  # the critical path first: stage 0 waits for these tokens
        if sampled and self.links.results is not None:
            self.links.results(sampled)
        return sampled if self.is_first else []

    def _sample(self, row: Row, seq: Sequence, logits: torch.Tensor) -> TokenRow:
        position = row.position + row.count
        token = sample(logits, seq.params, seq.seed, position)
        seq.generated += 1
        flags = RowFlag.NONE
        if token in seq.params.stop_token_ids:
            flags |= RowFlag.DONE | RowFlag.STOPPED
        elif seq.generated >= seq.params.max_tokens or position + 1 >= seq.context_length:
            flags |= RowFlag.DONE
        seq.done = bool(flags & RowFlag.DONE)
        return TokenRow(row.request, position, token, row.hash_after, prefix_hash(row.hash_after, [token]), int(flags))


def _check_unique(request: int, work: list[Work]) -> None:
    """One row per request in a batch: a second would run on the same cache positions."""
    if any(row.request == request for row, _, _ in work):
        raise OutOfStep(f"request {request} has two rows in one frame")
