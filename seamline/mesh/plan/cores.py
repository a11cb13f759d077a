"""Nodes that share a machine's CPUs share its speed.

Each node measures its weight-streaming rate alone, when it joins. Two nodes pinned to one
core (or three started on a two-core machine) cannot each stream at that rate once both
work, and a planner that believed they could would move layers between them for no gain,
or plan a third node in that brings no core of its own. A node reports its machine (the
boot id, shared by the machine's containers and network namespaces) and its CPU affinity;
each CPU is divided evenly among the CPU nodes of that machine that may run on it.

A machine is a node's word, so a liar may name one of its own. Nodes whose control links come
from one address are taken to share a machine whatever they named: an address can take a
machine of its own away, never grant one (nodes behind one NAT, or on one machine's loopback,
share an address; a machine's containers have several). Nodes on other machines behind one NAT
are planned as if they shared their CPUs: a price of the doubt.
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
    address: str = ""  # where its control link comes from ("" unknown)


def core_shares(placements: Iterable[Placement]) -> dict[str, float]:
    """Per node, the share of its CPUs' time it can count on: 1 alone, 1/2 for two nodes on
    the same CPUs, and so on (an accelerator node, or one whose machine is unknown, 1)."""
    placed = list(placements)
    machine = machines(placed)
    users = Counter((machine[p.node_id], cpu) for p in placed if _shares(p) for cpu in p.cpus)
    return {
        p.node_id: sum(1 / users[(machine[p.node_id], cpu)] for cpu in p.cpus) / len(p.cpus)
        if _shares(p)
        else 1.0
        for p in placed
    }


def machines(placed: list[Placement]) -> dict[str, str]:
    """Per node, a name for the machine it is taken to run on: nodes that name one machine, or
    whose links come from one address, and so on through either, share it."""
    parent = {p.node_id: p.node_id for p in placed}

    def root(node: str) -> str:
        while parent[node] != node:
            node = parent[node]
        return node

    first: dict[tuple[str, str], str] = {}  # ("host" or "address", its value) -> a node there
    for p in placed:
        for key in (("host", p.host), ("address", p.address)):
            if key[1]:
                parent[root(p.node_id)] = root(first.setdefault(key, p.node_id))
    return {p.node_id: root(p.node_id) for p in placed}


def _shares(placement: Placement) -> bool:
    return (
        bool(placement.host or placement.address)
        and bool(placement.cpus)
        and (placement.device == "cpu")
    )
