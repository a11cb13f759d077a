"""Moving a route's boundaries, its nodes kept in their order (a re-balance: ``mesh.control.balance``).

A route re-balanced from measured step times keeps each node where it is: what a node measured
under load depends on its place as much as on the node (the first stage's core may also run the
coordinator's API; the last computes the head for every row), so a correction learned in one
place says little of another. Only the layers between the nodes move.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from seamline.mesh.plan.pricing import Route, range_bytes
from seamline.mesh.plan.split import split_stage
from seamline.mesh.plan.types import ModelSpec, NodeInfo, PlanOptions

MAX_STAGES = 16  # a longer route is not re-balanced: the search is S x L^2 stage prices


def least_bottleneck_cuts(
    model: ModelSpec, nodes: Mapping[str, NodeInfo], options: PlanOptions, order: Sequence[str]
) -> Route | None:
    """The contiguous ranges over ``order`` whose slowest stage under load (``Split.load_s``) is
    least, every stage fitting its node and owning a layer at least; None when none fits."""
    L, S = model.num_layers, len(order)
    if not 1 <= S <= min(MAX_STAGES, L):
        return None
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(S + 1)]  # best[k][e]: the first k stages own [0, e)
    cut = [[0] * (L + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for k in range(1, S + 1):
        node = nodes[order[k - 1]]
        for e in range(k, L - (S - k) + 1):
            for s in range(k - 1, e):
                if best[k - 1][s] == inf or (k == S and e != L):
                    continue
                split = split_stage(model, options, node, s, e, range_bytes(model, options, s, e))
                worst = max(best[k - 1][s], split.load_s or split.read_s) if split.fits else inf
                if worst < best[k][e]:
                    best[k][e], cut[k][e] = worst, s
    if best[S][L] == inf:
        return None
    route, e = [], L
    for k in range(S, 0, -1):
        s = cut[k][e]
        route.append((order[k - 1], s, e))
        e = s
    return route[::-1]
