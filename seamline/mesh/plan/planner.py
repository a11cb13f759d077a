"""The planner: a pure function from a model, a pool of nodes and their links to a Plan.

A plan is a pipeline: an ordered subset of nodes, each owning a contiguous half-open layer
range, the ranges covering ``[0, L)`` exactly once; stage 0 also holds the embedding, the
last stage the final norm and head. A node fits when its weights plus the KV cache of its
layers (``context_tokens × batch``) fit in its free memory less headroom. A node with a GPU
(``NodeInfo.devices``) holds a stage's first layers there and the rest in system memory, each
layer read at its device's rate (``plan.split``); a pool without GPUs plans as the CPUs alone.

Objective (``PlanOptions.objective``). ``throughput`` (the default): with several micro-batches
in flight every stage works at once, so the pipeline delivers tokens at the pace of its slowest
stage; the planner first finds the least possible slowest-stage work under load (bisection
over stage costs, each probe a search with costlier stages ruled out), then among plans that
reach it takes the one with the lowest time per token below. Under load a stage's work
follows its rows, not its bytes: the head counts as ``ModelSpec.head_load()``. ``latency``:
that time alone (one sequence at a time). Links count only in the latency: a hop's frame is small against a stage's
compute (a 1 GbE link carries a decode row of the embedded model in ~10 µs).

Predicted seconds per decode step (one token for every sequence of the batch):
  Σ stages (weight bytes read per token [+ head on the last]) / device rate    (memory-bound)
  + Σ hops (latency + batch × hidden frame / bandwidth)
  + the return hop last -> stage 0 carrying the token ids (none for a single node).
Among plans of equal time the most even one wins: the DP minimises Σt + κΣt² over stage
times t, with κ so small (1e-6 of the fastest single-node time) that it only breaks ties.

Method. For a fixed node order the problem is a shortest path over states (node position
j, layers covered e): node j takes ``[s, e)`` after any earlier node p took ``[.., s)``,
paying the p -> j hop. Skipping is free, so every subsequence of the order and every cut
point is searched: exact for that order, in O(N²·L + N·L·D) per order (D: the most layers
one node can hold; O(N·L·D) with uniform links), vectorised with NumPy. A pipeline pays
the cheapest possible return hop into its first node when it starts, the rest when it ends:
exact whenever the return hop's cost depends only on the first node (uniform links, or a
first node whose link is the slower end). Orders tried: nodes by rate, descending
and ascending (the head, read every token, ends on the slowest or fastest chosen node); by
memory with the largest at both ends (they hold embedding and head), both ways; and a
nearest-link chain from the fastest node, both ways (keeps well-linked nodes adjacent). If
none fits, a last order puts first the node losing fewest layers to the embedding and last
the one losing fewest to the head: with equal layers, a pool it cannot fit cannot hold the
model. With uniform links the order matters only through who is first and last and how
uneven layers pack. Pools of at most ``EXHAUSTIVE_NODES`` nodes try every order with the
first node fixed: exact, return hop included (tests check it against brute force).
Against brute force on 300 random tight pools of 6-7 nodes: uniform links 89/89 optimal;
per-node links 104/107 (worst 3% slower); random per-pair links 100/104 (worst 6%).

Before the DP, a node is dropped when at least L others are no worse in memory, rate,
latency and bandwidth (ties broken by node_id): a plan uses at most L nodes, so one of them
is free to replace it at no cost. Nodes named in explicit link pairs are never dropped.
Deterministic: nodes are indexed by node_id and every argmin takes the first minimum.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from seamline.mesh.plan.pricing import TOKEN_ID_BYTES, check_plan, price_route
from seamline.mesh.plan.split import capacities, planning_rate, shortfall_note, split_band
from seamline.mesh.plan.types import (
    LinkCost,
    LinkTable,
    ModelSpec,
    NodeInfo,
    Plan,
    PlanError,
    PlanOptions,
)

__all__ = ["PlanError", "check_plan", "plan", "price_route"]

BALANCE_WEIGHT = 1e-6  # κ × (fastest single-node time): ties go to the most even plan
EXHAUSTIVE_NODES = 5
OBJECTIVES = ("throughput", "latency")
BOTTLENECK_TOLERANCE = (
    0.01  # pools beyond EXHAUSTIVE_NODES: the slowest stage within 1% of the least
)
INF = float("inf")


@dataclass(frozen=True)
class _RangeCosts:
    """Per-range costs in band form: [d, e] is the range [e-1-d, e); inf where it starts < 0."""

    L: int
    mem: np.ndarray  # [L, L+1] bytes a node needs to own the range
    read: np.ndarray  # [L, L+1] bytes read per token, head included when e == L
    load: np.ndarray  # [L, L+1] work per step under load (ModelSpec.head_load for the head)
    span_need: np.ndarray  # [L] the least any range of d+1 layers needs (nondecreasing)
    held: (
        np.ndarray
    )  # [L+1] bytes (weights + KV) of the layers before each: a GPU's share (``split``)
    active: np.ndarray  # [L+1] bytes read per token of the layers before each
    layer_need: float  # a layer's mean need (weights + KV)
    embed: float  # bytes
    head: float  # the last stage's besides its layers (the multi-token-prediction layer's too)


@dataclass(frozen=True)
class _Pool:
    """The nodes worth planning over, indexed in node_id order, and every cost the DP reads."""

    ids: tuple[str, ...]
    cap: np.ndarray  # bytes after headroom
    rate: np.ndarray  # bytes per second (a node with a GPU: ``split.planning_rate``, to rank it)
    hop: np.ndarray  # [p, j] seconds for a frame p -> j
    ret: np.ndarray  # [p, j] seconds for the token ids p -> j
    ret_floor: np.ndarray  # [j] the cheapest return hop into j: charged when j starts a pipeline
    stage: tuple[
        np.ndarray, ...
    ]  # [i][d, e]: node i owning [e-1-d, e): t + κt², inf if it does not fit
    single: np.ndarray  # [i] node i owning the whole model alone, inf if it does not fit
    load: tuple[np.ndarray, ...]  # as ``stage``: seconds of work per step under load
    single_load: np.ndarray
    flat_hop: float | None  # every hop costs this (uniform links): the DP keeps a running min
    model: _RangeCosts


@dataclass(frozen=True)
class _Found:
    cost: float
    route: tuple[tuple[int, int, int], ...]  # (pool index, start, end)


def plan(
    model: ModelSpec,
    nodes: Sequence[NodeInfo],
    links: LinkTable | Mapping[tuple[str, str], LinkCost] | None,
    options: PlanOptions,
) -> Plan:
    """The pipeline with the lowest predicted time per token; PlanError if nothing fits."""
    table = LinkTable.of(links)
    _check_inputs(model, nodes, table, options)
    by_id = sorted(nodes, key=lambda n: n.node_id)
    pool = _pool(model, by_id, table, options, _model_tables(model, options))
    if options.objective == "throughput" and pool.ids:
        pool = _capped(pool, _least_bottleneck(pool))
    found = _search(pool) if pool.ids else None
    if found is None:
        raise PlanError(_refusal(model, by_id, options))
    route = [(pool.ids[i], s, e) for i, s, e in found.route]
    return price_route(model, by_id, table, options, route)


def _search(pool: _Pool) -> _Found | None:
    L = pool.stage[0].shape[1] - 1
    alone = int(pool.single.argmin())
    best = _Found(float(pool.single[alone]), ((alone, 0, L),)) if pool.single[alone] < INF else None
    orders, fixed_first, last_try = _orders(pool)
    found = _best(pool, orders, fixed_first, best)
    if (
        found is None and last_try
    ):  # a last try to fit: the nodes that lose least to embedding and head
        found = _best(pool, last_try, False, None)
    return found


def _orders(pool: _Pool) -> tuple[list[np.ndarray], bool, list[np.ndarray]]:
    """The node orders the search tries (see module doc), whether their first node is fixed,
    and the orders of its last try when none fits."""
    n = len(pool.ids)
    if n <= EXHAUSTIVE_NODES:
        return [np.array(p) for p in itertools.permutations(range(n))], True, []
    by_rate = np.lexsort((np.arange(n), -pool.cap, -pool.rate))
    chain = _chain(pool.hop, by_rate)
    by_mem = np.lexsort((np.arange(n), -pool.rate, -pool.cap))
    ends = _ends_first(by_mem)
    orders = _unique([by_rate, by_rate[::-1], ends, ends[::-1], chain, chain[::-1]])
    return orders, False, _fit_orders(pool, by_mem)


def _least_bottleneck(pool: _Pool) -> float:
    """The least achievable work per step under load of the slowest stage (inf when nothing
    fits). A plan whose every stage costs at most b exists iff the search over the pool
    capped at b finds one; links do not matter to that, so the probes search without them.
    Small pools: bisection over every stage cost (exact). Larger ones: geometric bisection to
    within ``BOTTLENECK_TOLERANCE`` (their stage costs number millions)."""
    probe = replace(
        pool,
        hop=np.zeros_like(pool.hop),
        ret=np.zeros_like(pool.ret),
        ret_floor=np.zeros_like(pool.ret_floor),
        flat_hop=0.0,
    )

    def feasible(limit: float) -> bool:
        return _fits(_capped(probe, limit))

    finite = [b[np.isfinite(b)].ravel() for b in (*pool.load, pool.single_load)]
    highest = max((float(v.max()) for v in finite if len(v)), default=INF)
    if not highest < INF or not feasible(highest):
        return INF
    if len(pool.ids) > EXHAUSTIVE_NODES:
        low = min(float(v.min()) for v in finite if len(v))
        while highest > low * (1 + BOTTLENECK_TOLERANCE):
            middle = float(np.sqrt(low * highest))
            low, highest = (low, middle) if feasible(middle) else (middle, highest)
        return highest
    values = np.unique(np.concatenate(finite))
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if feasible(float(values[mid])) else (mid + 1, hi)
    return float(values[lo])


def _fits(pool: _Pool) -> bool:
    """Whether the search would find a plan: the same orders, stopping at the first that fits."""
    if (pool.single < INF).any():
        return True
    orders, fixed_first, last_try = _orders(pool)
    return any(_solve(pool, order, fixed_first) is not None for order in orders) or any(
        _solve(pool, order, False) is not None for order in last_try
    )


def _capped(pool: _Pool, limit: float) -> _Pool:
    """The pool with every stage (and single node) whose work under load exceeds ``limit`` ruled out."""
    if not limit < INF:
        return pool
    stage = tuple(np.where(load <= limit, band, INF) for band, load in zip(pool.stage, pool.load))
    return replace(pool, stage=stage, single=np.where(pool.single_load <= limit, pool.single, INF))


def _fit_orders(pool: _Pool, by_mem: np.ndarray) -> list[np.ndarray]:
    """[first, rest by memory, last]: first the node losing fewest layers to the embedding,
    last the one losing fewest to the head. With equal layers, if these do not fit none does."""
    per, cap = pool.model.layer_need, pool.cap
    plain = np.floor(cap / per)
    with_embed, with_head = (
        np.floor((cap - pool.model.embed) / per),
        np.floor((cap - pool.model.head) / per),
    )
    lose_embed = np.where(with_embed >= 1, plain - with_embed, INF)  # an end stage owns a layer too
    lose_head = np.where(with_head >= 1, plain - with_head, INF)

    def least(loss: np.ndarray, among: np.ndarray) -> int:
        return int(among[np.argmin(loss[among])])  # by_mem order breaks ties

    def order(first: int, last: int) -> np.ndarray:
        return np.concatenate(([first], by_mem[(by_mem != first) & (by_mem != last)], [last]))

    first, last = least(lose_embed, by_mem), least(lose_head, by_mem)
    if first != last:
        return [order(first, last)]
    return [
        order(first, least(lose_head, by_mem[by_mem != first])),
        order(least(lose_embed, by_mem[by_mem != last]), last),
    ]


def _ends_first(ranked: np.ndarray) -> np.ndarray:
    """The best-ranked nodes at both ends, the worst in the middle: 0, 2, 4, ..., 5, 3, 1."""
    return np.concatenate((ranked[0::2], ranked[1::2][::-1]))


def _best(
    pool: _Pool, orders: list[np.ndarray], fixed_first: bool, best: _Found | None
) -> _Found | None:
    for order in orders:
        found = _solve(pool, order, fixed_first)
        if found is not None and (best is None or found.cost < best.cost):
            best = found
    return best


def _unique(orders: list[np.ndarray]) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for order in orders:
        if not any(np.array_equal(order, o) for o in out):
            out.append(order)
    return out


def _chain(hop: np.ndarray, by_rate: np.ndarray) -> np.ndarray:
    """From the fastest node, repeatedly the unvisited node nearest by link (ties: by rate)."""
    n = len(by_rate)
    dist = hop[np.ix_(by_rate, by_rate)]  # indices are positions in by_rate
    seen = np.zeros(n, dtype=bool)
    out = [0]
    seen[0] = True
    for _ in range(n - 1):
        nxt = int(np.where(seen, INF, dist[out[-1]]).argmin())
        out.append(nxt)
        seen[nxt] = True
    return np.asarray(by_rate[np.array(out)])


def _solve(pool: _Pool, order: np.ndarray, fixed_first: bool) -> _Found | None:
    """Best plan of two or more stages whose nodes follow ``order`` (see module doc).

    F[j, e]: cheapest cover of [0, e) whose last stage is node j ending at e.
    G[j, s]: cheapest cover of [0, s) with its frame delivered to node j (G[j, 0]: j starts).
    """
    n, L = len(order), pool.stage[0].shape[1] - 1
    hop = pool.hop[np.ix_(order, order)]
    into = np.ascontiguousarray(hop.T)[:, :, None]  # [j, p, 1]: p -> j
    F = np.full((n, L + 1), INF)
    G = np.full((n, L + 1), INF)
    via = np.empty((n, L - 1))  # scratch: every predecessor's offer
    ranges = np.empty((L, L + 1))  # scratch: every start's offer, in band form
    padded = np.full(2 * L + 1, INF)  # padded[L + s] = g[s]; before it, starts < 0
    g = padded[L:]
    starts = np.lib.stride_tricks.sliding_window_view(padded, L + 1)[::-1][1:]  # [d, e] = g[e-1-d]
    done = np.full(L - 1, INF)  # uniform links: min over p < j of F[p, 1:L]
    for j in range(n):
        g[0] = INF if fixed_first and j else pool.ret_floor[order[j]]
        if j and pool.flat_hop is not None:
            np.add(done, pool.flat_hop, out=g[1:L])  # min(F) + h == min(F + h) exactly
        elif j:
            np.add(F[:j, 1:L], into[j, :j], out=via[:j])
            via[:j].min(axis=0, out=g[1:L])
        band = pool.stage[order[j]]
        D = band.shape[0]
        np.add(starts[:D], band, out=ranges[:D])
        ranges[:D].min(axis=0, out=F[j])
        np.minimum(done, F[j, 1:L], out=done)
        G[j] = g
    return _finish(pool, order, hop, F, G)


def _finish(
    pool: _Pool, order: np.ndarray, hop: np.ndarray, F: np.ndarray, G: np.ndarray
) -> _Found | None:
    """Settle the return hop of the cheapest complete paths (each paid its floor at the start),
    walking back only while one can still win."""
    L = F.shape[1] - 1
    ends = F[:, L]
    best: _Found | None = None
    for j in np.argsort(ends, kind="stable"):
        if not ends[j] < INF or (best is not None and ends[j] >= best.cost):
            break
        route = _walk(pool, order, hop, F, G, int(j))
        first, last = route[0][0], route[-1][0]
        cost = float(ends[j] - pool.ret_floor[first] + pool.ret[last, first])
        if best is None or cost < best.cost:
            best = _Found(cost, route)
    return best


def _walk(
    pool: _Pool, order: np.ndarray, hop: np.ndarray, F: np.ndarray, G: np.ndarray, j: int
) -> tuple[tuple[int, int, int], ...]:
    """Recover the path into F[j, L] by redoing its argmins (same arithmetic, same ties)."""
    e = F.shape[1] - 1
    route: list[tuple[int, int, int]] = []
    while True:
        band = pool.stage[order[j]]
        d = np.arange(min(band.shape[0], e))
        s = e - 1 - int((G[j][e - 1 - d] + band[d, e]).argmin())
        route.append((int(order[j]), s, e))
        if s == 0:
            return tuple(reversed(route))
        j, e = int((F[:j, s] + hop[:j, j]).argmin()), s


def _model_tables(model: ModelSpec, options: PlanOptions) -> _RangeCosts:
    L = model.num_layers
    kv = np.asarray(model.layer_kv(), dtype=np.float64) * options.context_tokens * options.batch
    held = np.concatenate(([0.0], np.cumsum(np.asarray(model.layer_bytes, dtype=np.float64) + kv)))
    active = np.concatenate(([0.0], np.cumsum(np.asarray(model.active_bytes(), dtype=np.float64))))
    e = np.arange(L + 1)[None, :]
    s = e - 1 - np.arange(L)[:, None]  # [d, e]: the range [s, e) of d+1 layers
    valid = s >= 0
    s = np.maximum(s, 0)
    head = np.where(e == L, float(model.head_bytes), 0.0)
    mem = held[e] - held[s] + head + np.where(s == 0, float(model.embed_bytes), 0.0)
    mem += np.where(
        e == L, model.mtp_bytes + np.where(s > 0, float(model.mtp_embed_bytes), 0.0), 0.0
    )  # drafts
    if model.tied_embeddings:
        mem[L - 1, L] -= model.embed_bytes  # one node owns both: the shared matrix once
    mem = np.where(valid, mem, INF)
    read = np.where(valid, active[e] - active[s] + head, INF)
    load = read - head + np.where(e == L, float(model.head_load()), 0.0)
    span_need = np.maximum.accumulate(mem.min(axis=1))
    layer_need = float(np.mean(model.layer_bytes)) + float(kv.mean())
    return _RangeCosts(
        L,
        mem,
        read,
        load,
        span_need,
        held,
        active,
        layer_need,
        float(model.embed_bytes),
        float(model.head_bytes + model.mtp_held(1)),
    )


def _pool(
    model: ModelSpec,
    nodes: Sequence[NodeInfo],
    table: LinkTable,
    options: PlanOptions,
    costs: _RangeCosts,
) -> _Pool:
    """The nodes worth planning over (indexed by node_id) and every cost the DP reads. A node
    with a GPU counts both memories (``cap``) and is ranked by ``split.planning_rate``."""
    cpu_cap, gpu_cap = (
        np.array([capacities(n, options) for n in nodes], dtype=np.float64).reshape(-1, 2).T
    )
    cpu_rate = np.array([n.bytes_per_second for n in nodes], dtype=np.float64)
    gpu_rate = np.array(
        [a.bytes_per_second if (a := n.accelerator()) else 0.0 for n in nodes], dtype=np.float64
    )
    cap = cpu_cap + gpu_cap
    whole = float(costs.mem[costs.L - 1, costs.L])
    rate = np.array(
        [planning_rate(n, options, whole) if n.devices else n.bytes_per_second for n in nodes]
    )
    access = [table.access.get(n.node_id, table.default) for n in nodes]
    lat = np.array([a.latency_s for a in access], dtype=np.float64)
    bw = np.array([a.bandwidth_bytes_per_s for a in access], dtype=np.float64)
    paired = {x for pair in table.pairs for x in pair}
    explicit = np.array([n.node_id in paired for n in nodes], dtype=bool)
    devices = (cpu_cap, cpu_rate, gpu_cap, gpu_rate)
    keep = (cap >= costs.span_need[0]) & ~_dominated(devices, lat, bw, explicit, costs.L)
    idx = np.flatnonzero(keep)
    ids = tuple(nodes[int(i)].node_id for i in idx)
    lat_m, bw_m = np.maximum.outer(lat[idx], lat[idx]), np.minimum.outer(bw[idx], bw[idx])
    where = {node_id: k for k, node_id in enumerate(ids)}
    for (a, b), link in table.pairs.items():
        if a in where and b in where:
            for x, y in ((where[a], where[b]), (where[b], where[a])):
                lat_m[x, y], bw_m[x, y] = link.latency_s, link.bandwidth_bytes_per_s
    hop = lat_m + float(model.bytes_per_boundary_per_token * options.batch) / bw_m
    ret = lat_m + float(TOKEN_ID_BYTES * options.batch) / bw_m
    stage, single, load, single_load = _stage_costs(
        costs, cap[idx], rate[idx], tuple(d[idx] for d in devices)
    )
    off = hop[~np.eye(len(idx), dtype=bool)]
    flat = float(off[0]) if len(off) and (off == off[0]).all() else None
    others = np.where(np.eye(len(idx), dtype=bool), INF, ret)
    floor = others.min(axis=0) if len(idx) > 1 else np.zeros(len(idx))
    return _Pool(
        ids, cap[idx], rate[idx], hop, ret, floor, stage, single, load, single_load, flat, costs
    )


def _stage_costs(
    costs: _RangeCosts, cap: np.ndarray, rate: np.ndarray, devices: tuple[np.ndarray, ...]
) -> tuple[tuple[np.ndarray, ...], np.ndarray, tuple[np.ndarray, ...], np.ndarray]:
    """Per node: t + κt² for every range it can hold (t = seconds per token), inf elsewhere,
    cut to the longest span it can hold; and its cost alone (inf if the model does not fit).
    Then the same for the work per step under load (no κ term). ``devices``: each node's CPU
    capacity and rate, GPU capacity and rate (rate 0: it has none)."""
    cpu_cap, cpu_rate, gpu_cap, gpu_rate = devices
    L = costs.L
    kappa = BALANCE_WEIGHT * rate.max() / costs.read[L - 1, L] if len(rate) else 0.0
    spans = np.searchsorted(costs.span_need, cap, side="right")
    stages, loads = [], []
    single, single_load = np.full(len(rate), INF), np.full(len(rate), INF)
    for i in range(len(rate)):
        D = int(spans[i])
        if gpu_rate[i] > 0:  # a node with a GPU: its first layers there
            tables = (costs.mem[:D], costs.read[:D], costs.load[:D])
            fits, t, t_load = split_band(
                costs.held,
                costs.active,
                costs.embed,
                tables,
                (cpu_cap[i], cpu_rate[i]),
                (gpu_cap[i], gpu_rate[i]),
            )
        else:
            fits, t, t_load = (
                costs.mem[:D] <= cap[i],
                costs.read[:D] / rate[i],
                costs.load[:D] / rate[i],
            )
        band, load = np.where(fits, t + kappa * t * t, INF), np.where(fits, t_load, INF)
        if D == L and band[L - 1, L] < INF:
            single[i], single_load[i] = band[L - 1, L], load[L - 1, L]
            band[L - 1, L] = load[L - 1, L] = INF  # alone, a node has no hops: scored apart
        stages.append(band)
        loads.append(load)
    return tuple(stages), single, tuple(loads), single_load


def _dominated(
    devices: tuple[np.ndarray, ...],
    lat: np.ndarray,
    bw: np.ndarray,
    explicit: np.ndarray,
    max_stages: int,
) -> np.ndarray:
    """Nodes with at least ``max_stages`` others no worse in every respect (ties: node_id).
    ``devices`` as ``_stage_costs``: y is no worse than x on its GPU too when its GPU is at
    least as large as x's and as fast as x's GPU and x's CPU (it may hold x's CPU layers)."""
    cpu_cap, cpu_rate, gpu_cap, gpu_rate = devices
    gpu_rate = np.where(gpu_rate > 0, gpu_rate, cpu_rate)  # none: its layers run at its CPU's
    n = len(cpu_cap)
    if n <= max_stages:
        return np.zeros(n, dtype=bool)
    good = np.stack([cpu_cap, cpu_rate, gpu_cap, -lat, bw], axis=1)  # higher is better
    ge = (good[:, None, :] >= good[None, :, :]).all(axis=2)  # [y, x]: y no worse than x
    ge &= gpu_rate[:, None] >= np.maximum(gpu_rate, cpu_rate)[None, :]
    good = np.concatenate((good, gpu_rate[:, None]), axis=1)  # equal in every respect, for ties
    eq = (good[:, None, :] == good[None, :, :]).all(axis=2)
    earlier = np.arange(n)[:, None] < np.arange(n)[None, :]
    dom = ge & (~eq | earlier) & ~explicit[:, None] & ~explicit[None, :]
    return np.asarray(dom.sum(axis=0) >= max_stages, dtype=bool)


def _refusal(model: ModelSpec, nodes: Sequence[NodeInfo], options: PlanOptions) -> str:
    kv_layers = [kv * options.context_tokens * options.batch for kv in model.layer_kv()]
    need = model.weight_bytes() + sum(kv_layers)
    offers = [
        max(0, cpu) + gpu for cpu, gpu in (capacities(n, options) for n in nodes)
    ]  # a GPU's too
    have, biggest = sum(offers), max(offers)
    layer = max(range(model.num_layers), key=lambda i: model.layer_bytes[i])
    layer_need = model.layer_bytes[layer] + kv_layers[layer]
    why = (
        "" if need > have else ", yet the planner found no contiguous split of the layers that fits"
    )
    return (
        f"the pool cannot hold model {model.name!r}: it needs {need} bytes (weights "
        f"{model.weight_bytes()} + KV cache {sum(kv_layers)} for "
        f"{options.context_tokens} tokens x {options.batch} sequences), the {len(nodes)} "
        f"nodes offer {have} after headroom{why}; the largest layer (layer {layer}) needs "
        f"{layer_need} bytes, the largest node offers {biggest}{shortfall_note(need, offers, nodes)}"
    )


def _check_inputs(
    model: ModelSpec, nodes: Sequence[NodeInfo], table: LinkTable, options: PlanOptions
) -> None:
    L = model.num_layers
    if options.objective not in OBJECTIVES:
        raise PlanError(
            f"a plan's objective is one of {', '.join(OBJECTIVES)}, not {options.objective!r}"
        )
    if L < 1 or len(model.layer_bytes) != L or min(model.layer_bytes) < 0:
        raise PlanError(
            f"a model spec needs one byte count >= 0 per layer: {len(model.layer_bytes)} for {L}"
        )
    if model.layer_active_bytes and len(model.layer_active_bytes) != L:
        raise PlanError(
            f"layer_active_bytes needs {L} entries, not {len(model.layer_active_bytes)}"
        )
    if not nodes:
        raise PlanError("the pool cannot hold any model: it has no nodes")
    repeated = sorted(i for i, k in Counter(n.node_id for n in nodes).items() if k > 1)
    if repeated:
        raise PlanError(f"node ids must be unique; {repeated[0]!r} repeats")
    for n in nodes:
        if not (0 < n.bytes_per_second < INF) or n.free_memory_bytes < 0:
            raise PlanError(f"node {n.node_id!r} needs a positive finite rate and free memory >= 0")
        for d in n.devices:
            if not (0 < d.bytes_per_second < INF) or d.free_memory_bytes < 0 or not d.device:
                raise PlanError(
                    f"node {n.node_id!r}: a device needs a name, a positive finite rate and free memory >= 0"
                )
    for link in (table.default, *table.access.values(), *table.pairs.values()):
        if not (link.latency_s >= 0 and 0 < link.bandwidth_bytes_per_s):
            raise PlanError(f"a link needs latency >= 0 and bandwidth > 0, not {link}")
    if options.context_tokens < 1 or options.batch < 1 or not 0 <= options.headroom_fraction < 1:
        raise PlanError(
            "plan options need context_tokens >= 1, batch >= 1, 0 <= headroom_fraction < 1"
        )
