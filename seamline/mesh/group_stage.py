"""A lockstep group as a pipeline stage: the leader's StageWorker drives it like a Stage.

The leader node runs the StageWorker (frames, sequence checks, sampling) unchanged; each
forward and each cache's life is mirrored to the group's other ranks by the LockstepGroup.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seamline.parallel.lockstep import LockstepGroup


@dataclass(frozen=True)
class GroupCache:
    """A sequence's caches, held by every rank of the group under one id."""

    seq: int


class LockstepStage:
    def __init__(self, group: LockstepGroup) -> None:
        self.group = group
        self.config = group.config
        self.compute_dtype: torch.dtype = group.leader.stage.compute_dtype
        self.is_last = group.leader.last

    def new_cache(self, greedy: bool = False) -> GroupCache:
        return GroupCache(self.group.create(greedy))

    def release_cache(self, cache: GroupCache) -> None:
        self.group.destroy(cache.seq)

    def __call__(self, inputs: torch.Tensor, start: int, cache: GroupCache, last_only: bool = False) -> torch.Tensor:
        """Ids or hidden states in; hidden states out, or the last position's logits [1, vocab]."""
        out = self.group.run(cache.seq, start, inputs)
        return out.unsqueeze(0) if self.is_last else out

    def close(self) -> None:
        self.group.close()
