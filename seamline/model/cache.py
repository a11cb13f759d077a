"""Per-sequence KV cache (one pair of growable buffers per owned layer), and ``Span``: the rows
of one sequence in a batched step.

A buffer holds [heads, capacity, dim] (any trailing shape: latent-KV attention stores its
compressed state here too). Writes go to explicit positions, so rewinding a sequence is
just writing from an earlier position; nothing past ``start + count`` is ever read.

A sliding-window layer's buffer is a ring (``ring_size``): position p in slot p % ring, at
most its window and ``RING_SLACK`` positions held, so its memory stays that of its window
whatever the context. The slack (``config.RING_SLACK``) is what a rewind may go back past the furthest position
written (a rejected speculative window) and still find the keys its window sees.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from seamline.config import ring_size

MIN_CAPACITY = 256


class CacheOverrun(RuntimeError):
    """A step went back further than a sliding layer's ring still holds."""


def grown(capacity: int, end: int, limit: int | None = None) -> int:
    """The positions a buffer of ``capacity`` positions holds once it holds ``end``: as it is
    while it has room, else at least ``MIN_CAPACITY`` and twice what it was, but no more than
    ``limit`` (the most its sequence may need; never fewer than ``end``). The scheduler counts
    a sequence's memory by this rule, so that its budget bounds what the buffers take."""
    if capacity >= end:
        return capacity
    wanted = max(end, MIN_CAPACITY, 2 * capacity)
    return wanted if limit is None else max(end, min(wanted, limit))


class LayerKV:
    """Two growable buffers (keys, values), indexed by position along dim 1 (a ring of ``ring``
    slots for a sliding layer: ``window_update``)."""

    def __init__(self, limit: int | None = None, ring: int = 0) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.limit = limit  # the most positions its sequence may need (None: unbounded)
        self.ring = ring
        self.held_from = 0  # a ring's oldest position still held

    def window_update(
        self, k: torch.Tensor, v: torch.Tensor, start: int, window: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A ring's ``update``: write k, v ([heads, T, dim]) at positions [start, start+T); return
        the keys and values of positions [first, start+T) and ``first``, the oldest a row of
        theirs sees (start - window + 1)."""
        end, first = start + k.shape[1], max(0, start - window + 1)
        if first < self.held_from:
            raise CacheOverrun(
                f"a step at position {start} needs keys from {first}; this sliding layer's "
                f"ring of {self.ring} holds them from {self.held_from}"
            )
        held = min(end, self.ring)
        bound = min(self.limit, self.ring) if self.limit is not None else self.ring
        self.k, self.v = _fit(self.k, k, held, bound), _fit(self.v, v, held, bound)
        keys = torch.cat((self._read(self.k, first, start), k), dim=1)
        values = torch.cat((self._read(self.v, first, start), v), dim=1)
        kept = max(start, end - self.ring)  # a chunk longer than the ring keeps its last positions
        for slot, lo, hi in self._slots(kept, end):
            self.k[:, slot : slot + hi - lo] = k[:, lo - start : hi - start]
            self.v[:, slot : slot + hi - lo] = v[:, lo - start : hi - start]
        self.held_from = max(self.held_from, end - self.ring)
        return keys, values, first

    def _slots(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Positions [lo, hi) as (first slot, from, to) runs that do not wrap."""
        runs = []
        while lo < hi:
            slot = lo % self.ring
            upto = min(hi, lo + self.ring - slot)
            runs.append((slot, lo, upto))
            lo = upto
        return runs

    def _read(self, buf: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        runs = [buf[:, slot : slot + b - a] for slot, a, b in self._slots(lo, hi)]
        return runs[0] if len(runs) == 1 else torch.cat(runs, dim=1) if runs else buf[:, :0]

    def update(
        self, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v ([heads, T, dim]) at positions [start, start+T); return [heads, :start+T, dim]."""
        end = start + k.shape[1]
        self.k = _fit(self.k, k, end, self.limit)
        self.v = _fit(self.v, v, end, self.limit)
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        return self.k[:, :end], self.v[:, :end]

    def reserve(
        self, heads: int, dim: int, end: int, dtype: torch.dtype, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole buffers [heads, capacity >= end, dim] (on ``device``: the rows'), for a
        kernel that writes them itself."""
        if self.k is None or self.v is None or self.k.shape[1] < end:
            like = torch.empty(heads, 0, dim, dtype=dtype, device=device)
            self.k, self.v = (
                _fit(self.k, like, end, self.limit),
                _fit(self.v, like, end, self.limit),
            )
        return self.k, self.v

    def fork(self, length: int, limit: int | None = None) -> LayerKV:
        """A new pair holding a copy of positions [0, length) (a shared prompt prefix), bounded
        by ``limit``; a ring's copy holds those it still has (``SequenceCache.holds``)."""
        twin = LayerKV(limit, self.ring)
        if self.ring and self.k is not None and self.v is not None and length > 0:
            twin.k, twin.v = self.k.clone(), self.v.clone()  # a ring: slots stay where they are
            twin.held_from = max(self.held_from, length - self.ring)
        elif self.k is not None and self.v is not None and length > 0:
            twin.k, twin.v = _fit(None, self.k, length, limit), _fit(None, self.v, length, limit)
            twin.k[:, :length] = self.k[:, :length]
            twin.v[:, :length] = self.v[:, :length]
        return twin


def _fit(buf: torch.Tensor | None, like: torch.Tensor, end: int, limit: int | None) -> torch.Tensor:
    if buf is not None and buf.shape[1] >= end:
        return buf
    capacity = grown(buf.shape[1] if buf is not None else 0, end, limit)
    bigger = like.new_empty((like.shape[0], capacity, *like.shape[2:]))
    if buf is not None:
        bigger[:, : buf.shape[1]] = buf
    return bigger


class SequenceCache:
    """The KV state of one sequence for the layers one process owns."""

    def __init__(
        self,
        layers: Iterable[int],
        limit: int | None = None,
        rings: Mapping[int, int] | None = None,
        window: int = 0,
    ) -> None:
        """``rings``: the sliding layers' ring sizes; ``window``: the model's sliding window (any
        stage's caches tell alike what a fork can start from, whichever layers they hold)."""
        self.limit = limit
        self.rings = dict(rings or {})
        self.window, self.ring = window, ring_size(window)
        self.held_from = 0  # the oldest position every sliding layer of the model still holds
        self.layers = {i: LayerKV(limit, self.rings.get(i, 0)) for i in layers}
        # a pipeline's last stage: (position, final state) of the drafting layer's row whose next
        # token comes with the next prompt chunk (``runtime/mtp_drafts.py``)
        self.draft_pending: tuple[int, torch.Tensor] | None = None

    def bound(self, positions: int) -> None:
        """Never grow past ``positions`` (the most its sequence may need: prompt + max_tokens)."""
        self.limit = positions
        for kv in self.layers.values():
            kv.limit = positions

    def wrote(self, end: int) -> None:
        """A step wrote positions up to ``end``: a ring of the model's has moved past ``end - ring``."""
        if self.ring:
            self.held_from = max(self.held_from, end - self.ring)

    def holds(self, length: int) -> bool:
        """Whether a fork of its first ``length`` positions has every key its next step sees."""
        return not self.window or max(0, length - self.window + 1) >= self.held_from

    def capacity(self) -> int:
        """The positions its buffers hold (0 before its first write)."""
        return max((kv.k.shape[1] for kv in self.layers.values() if kv.k is not None), default=0)

    def layer(self, index: int) -> LayerKV:
        return self.layers[index]

    def nbytes(self) -> int:
        """Bytes its buffers take (their capacity, not only the positions written)."""
        return sum(t.nbytes for kv in self.layers.values() for t in (kv.k, kv.v) if t is not None)

    def fork(self, length: int, limit: int | None = None) -> SequenceCache:
        """A new cache starting with a copy of this one's positions [0, length), bounded by
        ``limit`` (see ``bound``)."""
        twin = SequenceCache(range(0), limit, self.rings, self.window)
        twin.held_from = max(self.held_from, length - self.ring) if self.ring else 0
        twin.layers = {i: kv.fork(length, limit) for i, kv in self.layers.items()}
        return twin


@dataclass(frozen=True)
class Span:
    """Rows [offset, offset + count) of a step's input: one sequence's tokens at its positions
    [start, start + count), attending over (and written into) ``cache``. A step's spans are in
    row order and cover every row once: decode rows (count 1) and prefill chunks may mix."""

    offset: int
    count: int
    start: int
    cache: SequenceCache
    rowwise: bool = (
        False  # each row computed as a one-row step at its position would be (a speculative window)
    )

    @property
    def end(self) -> int:
        return self.offset + self.count


def logit_rows(spans: Sequence[Span]) -> list[int]:
    """The rows a step that draws needs logits of: every row of a speculative window (a draw
    after each), the last of any other span."""
    return [row for s in spans for row in (range(s.offset, s.end) if s.rowwise else [s.end - 1])]


def logits_by_span(spans: Sequence[Span], logits: torch.Tensor) -> list[torch.Tensor]:
    """``logits`` of ``logit_rows(spans)`` cut per span: a window's [rows, vocab], any other's [vocab]."""
    pieces, first = [], 0
    for s in spans:
        count = s.count if s.rowwise else 1
        pieces.append(logits[first : first + count] if s.rowwise else logits[first])
        first += count
    return pieces
