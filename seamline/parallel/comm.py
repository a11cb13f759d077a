"""Comm: the one interface every collective goes through.

``all_reduce`` sums the ranks' partial results at a gate (two gates per layer: after
attention and after the feed-forward); ``all_gather`` concatenates per-rank slices in rank
order (logits split by vocabulary rows). Each call carries a ``GateTag``; a rank that receives
a different tag than it expects raises ``DesyncError`` — never a silent wrong sum. With one
rank, ``SingleComm`` does nothing, so the same model code runs unsplit.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol, runtime_checkable

import torch

from seamline.errors import SeamlineError


class CommError(SeamlineError):
    """A collective failed: a peer died, went silent, closed its link or refused the group.

    ``peer`` is the rank at fault when one is known, so a caller can name its node.
    """

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class DesyncError(CommError):
    """Ranks are out of step: a peer sent a different gate (or shape) than this rank expected."""


class GateTag(NamedTuple):
    """Which gate a message belongs to: (layer, gate within the layer, step sequence number)."""

    layer: int
    gate: int
    sequence: int

    def __str__(self) -> str:
        return f"({self.layer},{self.gate},#{self.sequence})"


# Tag of all_gather calls made without one (e.g. the logits gather after the last layer).
GATHER_TAG = GateTag(-1, 0, 0)


@runtime_checkable
class Comm(Protocol):
    rank: int
    world: int

    def all_reduce(self, tensor: torch.Tensor, tag: GateTag) -> torch.Tensor:
        """Sum of every rank's ``tensor`` (same shape and dtype on all ranks); may be in place."""
        ...

    def all_gather(self, tensor: torch.Tensor, dim: int, tag: GateTag = GATHER_TAG) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order (sizes along dim may differ)."""
        ...

    def close(self) -> None: ...


class SingleComm:
    """World of one: every collective returns its input."""

    rank = 0
    world = 1

    def all_reduce(self, tensor: torch.Tensor, tag: GateTag) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int, tag: GateTag = GATHER_TAG) -> torch.Tensor:
        return tensor

    def close(self) -> None:
        pass


def sum_in_rank_order(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The ranks' flat ``parts`` added in rank order, as every rank does: bit-identical sums.
    Half floats add up in float32; the sum comes back in ``dtype``."""
    if dtype in (torch.bfloat16, torch.float16):
        parts = [part.float() for part in parts]
    total = parts[0] + parts[1]
    for part in parts[2:]:
        total.add_(part)
    return total.to(dtype)


def fingerprint_difference(rank: int, mine: str, peer: int, theirs: str) -> str:
    """Name the fields in which two group fingerprints (``field|field|...``) differ."""
    a, b = mine.split("|"), theirs.split("|")
    diffs = [f"{x} here, {y} on rank {peer}" for x, y in zip(a, b) if x != y]
    if len(a) != len(b) or not diffs:
        return f"rank {rank} has fingerprint {mine!r}, rank {peer} has {theirs!r}"
    return f"rank {rank} has " + "; ".join(diffs)


Transport = Literal["auto", "tcp", "torch"]
