"""Measured node speeds: the rate a node is planned at (what it claimed, no more than it proved
or its stage served), steadied before planning: nodes that measure within noise of each other
plan as equals."""

from __future__ import annotations

from dataclasses import replace

from seamline.mesh.plan.types import NodeInfo

PROVEN_ALLOWANCE = 1.2  # a claim is believed up to this much above the rate the node proved
RATE_NOISE = (
    0.15  # like machines measured this far apart on a busy host (a neighbour starting, say)
)


def planned_rate(claimed: float, proven: float | None, served: float | None = None) -> float:
    """The rate a node is planned at: its claim, at most ``PROVEN_ALLOWANCE`` times what it proved
    on the coordinator's timed product (a busy moment may slow an honest node's proof, never
    speed a liar's), and at most what its stage served at when it served clearly slower
    (``serving_pace``). ``None``: not measured yet."""
    rate = claimed if proven is None else min(claimed, PROVEN_ALLOWANCE * proven)
    return rate if served is None else min(rate, served)


def steady_rates(nodes: list[NodeInfo], noise: float = RATE_NOISE) -> list[NodeInfo]:
    """``nodes`` with each group of rates that lie within ``noise`` of the group's slowest given
    the group's mean rate. Two like machines measured 15% apart should not get different shares
    (a 15 + 15 split where 17 + 13 balances the head); machines that truly differ keep theirs."""
    groups: list[list[NodeInfo]] = []
    for node in sorted(nodes, key=lambda n: n.bytes_per_second):
        if groups and node.bytes_per_second <= groups[-1][0].bytes_per_second * (1 + noise):
            groups[-1].append(node)
        else:
            groups.append([node])
    rate = {
        n.node_id: sum(m.bytes_per_second for m in group) / len(group)
        for group in groups
        for n in group
    }
    return [replace(n, bytes_per_second=rate[n.node_id]) for n in nodes]
