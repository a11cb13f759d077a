"""The leader's side of a lockstep group: rank 0 mirrors every session call (create, fork,
prefill/decode, batch, rewind, destroy) to the other ranks and applies it to its own shard, and
pings them while idle so their gate timeouts fire only when it is really gone. The ranks, the
command's layout and the non-leader loop are ``lockstep_group.py``'s."""

from __future__ import annotations

import threading
import time

import torch

from seamline.errors import ConfigError
from seamline.parallel.comm import CommError
from seamline.runtime.lockstep_group import (
    BATCH,
    CREATE,
    DECODE,
    DESTROY,
    FORK,
    GREEDY,
    OP_NAMES,
    PING,
    PREFILL,
    REWIND,
    SHUTDOWN,
    SPAN_COLUMNS,
    HiddenWithIds,
    Inputs,
    LockstepRank,
    input_rows,
)


class LockstepGroup:
    """The leader's side: session calls mirrored to every rank. Generation runs the one
    scheduler loop over the group (``Engine(LockstepStage(group))``, runtime/group_stage.py)."""

    def __init__(self, leader: LockstepRank, context_length: int | None = None) -> None:
        if leader.rank != 0:
            raise ConfigError(f"a LockstepGroup is driven by rank 0, not rank {leader.rank}")
        self.leader = leader
        self.config = leader.config
        self.context_length = context_length or self.config.max_position_embeddings
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._next_seq = 1
        self.greedy_exchange = True  # greedy sequences exchange (max, argmax), not logits
        self._closed = threading.Event()
        self._broken: CommError | None = None
        self._interval = leader.timeout_s / 3
        self._pinger = threading.Thread(target=self._ping_loop, daemon=True)
        self._pinger.start()

    def call(
        self,
        op: int,
        seq: int,
        position: int = 0,
        inputs: Inputs | None = None,
        flags: int = 0,
        spans: torch.Tensor | None = None,
        donor: int = 0,
    ) -> torch.Tensor | None:
        """Mirror one session call to every rank and apply it here (for BATCH, ``seq`` is the
        number of spans and ``spans`` their table)."""
        count = input_rows(inputs)
        with self._lock:
            if self._broken:
                raise CommError(
                    f"lockstep group is broken since: {self._broken}", peer=self._broken.peer
                )
            try:
                cmd, got, table = self.leader.exchange(
                    [op, seq, position, count, flags, 0, donor], inputs if count else None, spans
                )
                self._last = time.monotonic()
                return self.leader.apply(cmd, got, table)
            except CommError as exc:
                self._broken = exc
                raise CommError(
                    f"lockstep {OP_NAMES.get(op, op)} failed: {exc}", peer=exc.peer
                ) from None

    def create(self, greedy: bool = False) -> int:
        """A new sequence on every rank; a ``greedy`` one gets logits that are -inf but at the
        argmax (see ``LockstepRank._gather_logits``) unless ``greedy_exchange`` is off."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self.call(CREATE, seq, flags=GREEDY if greedy and self.greedy_exchange else 0)
        return seq

    def fork(self, donor: int, positions: int) -> int:
        """A new sequence on every rank holding a copy of ``donor``'s first ``positions``."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self.call(FORK, seq, positions, donor=donor)
        return seq

    def run(self, seq: int, position: int, inputs: torch.Tensor | HiddenWithIds) -> torch.Tensor:
        """One forward of ``inputs`` (ids or hidden states) at ``position`` on every rank."""
        out = self.call(DECODE if input_rows(inputs) == 1 else PREFILL, seq, position, inputs)
        assert out is not None
        return out

    def batch(self, spans: torch.Tensor, inputs: torch.Tensor | HiddenWithIds) -> torch.Tensor:
        """One forward of many sequences' rows on every rank: ``spans`` [n, 3] of (seq,
        position, rows) in row order, or [n, 4] with flags (``WINDOW``: a speculative window,
        whose every row gets logits). Each span's last logits [n, vocab] (and a window's every
        row's), or every row's hidden states (a stage before the head)."""
        if spans.shape[1] < SPAN_COLUMNS:
            spans = torch.cat(
                [
                    spans,
                    torch.zeros(spans.shape[0], SPAN_COLUMNS - spans.shape[1], dtype=spans.dtype),
                ],
                1,
            )
        out = self.call(BATCH, spans.shape[0], 0, inputs, spans=spans)
        assert out is not None
        return out

    def rewind(self, seq: int, position: int) -> None:
        self.call(REWIND, seq, position)

    def destroy(self, seq: int) -> None:
        self.call(DESTROY, seq)

    @property
    def broken(self) -> bool:
        """Whether a rank was lost: every later call raises CommError."""
        return self._broken is not None

    def _ping_loop(self) -> None:
        """Keep idle non-leaders from timing out; notice a dead rank while idle."""
        while not self._closed.wait(self._interval / 2):
            if time.monotonic() - self._last < self._interval or not self._lock.acquire(
                blocking=False
            ):
                continue
            try:
                if not self._broken and not self._closed.is_set():
                    self.leader.exchange([PING])
                    self._last = time.monotonic()
            except CommError as exc:
                self._broken = exc
            finally:
                self._lock.release()

    def close(self) -> None:
        """Tell every rank to exit (best effort), then close the links."""
        self._closed.set()
        with self._lock:
            if not self._broken:
                try:
                    self.leader.exchange([SHUTDOWN])
                except CommError:
                    pass
            self._broken = self._broken or CommError("closed")
        self.leader.close()
