"""Measured node speeds, steadied before planning: nodes that measure within noise of each
other plan as equals."""

from __future__ import annotations

from dataclasses import replace

from seamline.mesh.plan.types import NodeInfo

RATE_NOISE = (
    0.15  # like machines measured this far apart on a busy host (a neighbour starting, say)
)


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
