"""Nodes that share a machine's CPUs share its speed.

Each node measures its weight-streaming rate alone, when it joins. Two nodes pinned to one
core (or three started on a two-core machine) cannot each stream at that rate once both
work, and a planner that believed they could would move layers between them for no gain,
or plan a third node in that brings no core of its own. A node reports its machine (the
boot id, shared by the machine's containers and network namespaces) and its CPU affinity;
each CPU is divided evenly among the CPU nodes of that machine that may run on it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    node_id: str
    host: str  # "" unknown: the node is taken to have its CPUs to itself
    cpus: frozenset[int]
    device: str = "cpu"


def core_shares(placements: Iterable[Placement]) -> dict[str, float]:
    """Per node, the share of its CPUs' time it can count on: 1 alone, 1/2 for two nodes on
    the same CPUs, and so on (an accelerator node, or one whose machine is unknown, 1)."""
    placed = list(placements)
    users = Counter((p.host, cpu) for p in placed if _shares(p) for cpu in p.cpus)
    return {
        p.node_id: sum(1 / users[(p.host, cpu)] for cpu in p.cpus) / len(p.cpus)
        if _shares(p)
        else 1.0
        for p in placed
    }


def _shares(placement: Placement) -> bool:
    return bool(placement.host and placement.cpus) and placement.device == "cpu"
