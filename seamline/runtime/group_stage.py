"""A lockstep group driven like a Stage: by the leader's StageWorker as a pipeline stage, or
by the scheduler (``Engine(LockstepStage(group))``) when the group owns the whole model.

Each forward (a batch of many sequences' rows in one command) and each cache's life is
mirrored to the group's other ranks by the LockstepGroup. ``embed``, ``head`` and ``layers``
are the leader's shard of them: what tells the scheduler the group owns both ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from seamline.model.cache import Span
from seamline.runtime.lockstep_group import WINDOW, HiddenWithIds
from seamline.runtime.lockstep_leader import LockstepGroup


@dataclass(frozen=True)
class GroupCache:
    """A sequence's caches, held by every rank of the group under one id."""

    seq: int
    group: LockstepGroup | None = field(default=None, compare=False, repr=False)

    def fork(self, positions: int) -> GroupCache:
        """A copy of positions [0, positions) on every rank, as ``SequenceCache.fork``."""
        assert self.group is not None, "a group cache made without its group"
        return GroupCache(self.group.fork(self.seq, positions), self.group)


class LockstepStage:
    def __init__(self, group: LockstepGroup) -> None:
        self.group = group
        self.config = group.config
        self.compute_dtype: torch.dtype = group.leader.stage.compute_dtype
        self.is_last = group.leader.last
        stage = group.leader.stage
        self.input_device: torch.device = (
            stage.input_device
        )  # the leader's: each rank computes on its own
        self.embed, self.head = stage.embed, stage.head
        self.layers = stage.layers
        # what the family's stage says of its frames and caches (DeepSeek-V4's differ)
        self.boundary_shape: tuple[int, ...] = stage.boundary_shape
        self.passes_ids, self.forks_caches = stage.passes_ids, stage.forks_caches
        # windows, where the ranks' caches may go back to a rejected draft's position
        self.verifies_drafts = getattr(stage, "verifies_drafts", False)
        self.cache_bytes = stage.cache_bytes

    def new_cache(self, greedy: bool = False) -> GroupCache:
        return GroupCache(self.group.create(greedy), self.group)

    def release_cache(self, cache: GroupCache) -> None:
        if not self.group.broken:  # a lost rank took every cache with it
            self.group.destroy(cache.seq)

    def __call__(
        self,
        inputs: torch.Tensor,
        start: int,
        cache: GroupCache,
        last_only: bool = False,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Ids or hidden states (with the rows' ``ids`` where the stage passes them) in; hidden
        states out, or the last position's logits [1, vocab]."""
        out = self.group.run(cache.seq, start, self._inputs(inputs, ids))
        return out.unsqueeze(0) if self.is_last else out

    forward = __call__  # as a Stage's: one sequence's rows

    def forward_batch(
        self,
        inputs: torch.Tensor,
        spans: Sequence[Span],
        last_only: bool = False,
        ids: torch.Tensor | None = None,
        logit_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Every span's rows in one mirrored BATCH command (one forward on every rank): hidden
        states of every row, or each span's last logits [len(spans), vocab], and every row's
        of a speculative window (the ranks pick ``logit_rows`` from the spans' flags)."""
        if len(spans) == 1 and not spans[0].rowwise:
            return self(inputs, spans[0].start, cast(GroupCache, spans[0].cache), last_only, ids)
        table = torch.tensor(
            [
                [cast(GroupCache, s.cache).seq, s.start, s.count, WINDOW if s.rowwise else 0]
                for s in spans
            ],
            dtype=torch.int64,
        )
        return self.group.batch(table, self._inputs(inputs, ids))

    def _inputs(
        self, inputs: torch.Tensor, ids: torch.Tensor | None
    ) -> torch.Tensor | HiddenWithIds:
        """A stage with the embedding takes the ids as its inputs; a later one, beside them."""
        return inputs if ids is None or self.embed is not None else HiddenWithIds(inputs, ids)

    def close(self) -> None:
        self.group.close()
