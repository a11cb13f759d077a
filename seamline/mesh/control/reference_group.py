"""A lockstep group's layers as the coordinator's reference computes them: every rank's shard
on a thread of its own (``parallel.thread_comm``), the gates summed in rank order and the
head's vocabulary shards gathered, as the group's ranks do over their links. A group's answer
is then the reference's to the bit, where the unsplit layers' differ by its rounding: a
bfloat16 group's probe over the embedded model's 30 layers read up to 9x the checks' tolerance
from the unsplit model's on one random probe in ten."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from seamline.config import ModelConfig
from seamline.model.cache import SequenceCache, Span
from seamline.model.stage import Stage
from seamline.ownership import rank_ownership
from seamline.parallel.thread_comm import ThreadGroup, run_ranks
from seamline.weights.loader import load_stage
from seamline.weights.source import TensorSource


class GroupStage:
    """The shards of one layer range for a group of ``len(shards)`` ranks, run as one stage:
    what the group's leader answers. A cache is one per rank."""

    def __init__(self, shards: list[Stage], group: ThreadGroup) -> None:
        self.shards, self.group = shards, group
        first = shards[0]
        self.head = first.head
        self.passes_ids = first.passes_ids
        self.boundary_shape = first.boundary_shape

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.shards[0].compute_dtype

    def new_cache(self) -> list[SequenceCache]:
        return [shard.new_cache() for shard in self.shards]

    def release_cache(self, cache: list[SequenceCache]) -> None:
        """Garbage, as a Stage's."""

    @torch.inference_mode()
    def forward_batch(
        self,
        inputs: torch.Tensor,
        spans: Sequence[Span],
        last_only: bool = False,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every rank's forward of the rows, each on its own caches; the leader's output, or
        with the head the ranks' logits side by side (ascending vocabulary, as gathered)."""
        work = [
            self._rank_work(rank, inputs, spans, last_only, ids) for rank in range(len(self.shards))
        ]
        outs = run_ranks(self.group, work)
        return torch.cat([out.float() for out in outs], -1) if self.head is not None else outs[0]

    def _rank_work(
        self,
        rank: int,
        inputs: torch.Tensor,
        spans: Sequence[Span],
        last_only: bool,
        ids: torch.Tensor | None,
    ) -> Callable[[], torch.Tensor]:
        shard = self.shards[rank]
        mine = [dataclasses.replace(span, cache=span.cache[rank]) for span in spans]  # type: ignore[index]
        if self.passes_ids and ids is not None:
            return lambda: shard.forward_batch(inputs, mine, last_only=last_only, ids=ids)  # type: ignore[call-arg]
        return lambda: shard.forward_batch(inputs, mine, last_only=last_only)


def load_group_stage(
    source: TensorSource,
    layers: tuple[int, int],
    world: int,
    dtype: torch.dtype,
    config: ModelConfig,
) -> GroupStage:
    """Every rank's shard of ``layers`` for a group of ``world``, joined by thread comms."""
    group = ThreadGroup(world)
    shards = [
        load_stage(source, rank_ownership(config, rank, world, layers), dtype, config, comm=comm)
        for rank, comm in enumerate(group.comms())
    ]
    return GroupStage(shards, group)
