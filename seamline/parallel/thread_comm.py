"""A lockstep group's ranks as threads of one process: how the coordinator computes what a
group answers (``mesh.control.reference``), with each rank's shard and the same sums.

A group's ranks round their partial results to the activation dtype before a gate, and the
gate adds them in rank order (``sum_in_rank_order``): not the arithmetic of the unsplit layer,
whose products are added before any rounding. On a random probe the difference grows layer
by layer past the checks' tolerance, so a group is held to the group's own arithmetic:
``ThreadComm`` sums exactly as ``TcpComm`` does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from seamline.parallel.comm import GATHER_TAG, CommError, DesyncError, GateTag, sum_in_rank_order

T = TypeVar("T")
GATE_TIMEOUT_S = 120.0  # a rank whose thread failed leaves the others waiting at most this long


class ThreadGroup:
    """What ``world`` thread-ranks share: a barrier and a slot per rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=GATE_TIMEOUT_S)
        self.slots: list[tuple[GateTag, torch.Tensor] | None] = [None] * world

    def comms(self) -> list[ThreadComm]:
        return [ThreadComm(self, rank) for rank in range(self.world)]


class ThreadComm:
    """One thread-rank's view of its ThreadGroup."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world = group, rank, group.world

    def _exchange(self, tag: GateTag, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor at this gate, in rank order."""
        self.group.slots[self.rank] = (tag, tensor.detach().contiguous())
        try:
            self.group.barrier.wait()
            slots = list(self.group.slots)
            self.group.barrier.wait()  # all have read before any writes again
        except threading.BrokenBarrierError:
            raise CommError(
                f"rank {self.rank}: another thread-rank failed before gate {tag}"
            ) from None
        tags = {slot[0] for slot in slots if slot is not None}
        if tags != {tag}:
            raise DesyncError(f"thread-ranks reached different gates: {sorted(map(str, tags))}")
        return [slot[1] for slot in slots if slot is not None]

    def all_reduce(self, tensor: torch.Tensor, tag: GateTag) -> torch.Tensor:
        parts = [part.reshape(-1) for part in self._exchange(tag, tensor)]
        return sum_in_rank_order(parts, tensor.dtype).view(tensor.shape)

    def all_gather(self, tensor: torch.Tensor, dim: int, tag: GateTag = GATHER_TAG) -> torch.Tensor:
        return torch.cat(self._exchange(tag, tensor), dim=dim)

    def close(self) -> None:
        pass


def run_ranks(group: ThreadGroup, work: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``work[r]`` as rank r, each on its own thread; their results in rank order. The
    first rank's exception is raised once all have stopped (a failed rank breaks the barrier,
    so the others stop at their next gate)."""
    results: list[T | None] = [None] * len(work)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = work[rank]()
        except BaseException as exc:
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(len(work))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]
