"""Planning a private mesh (``--private``): the route starts and ends on one node, the
coordinator's own. It holds the embedding with the first layers ``[0, a)`` and the last layers
``[b, L)`` with the head, and draws; the members hold ``[a, b)`` between, planned as any pool is
(``planner.plan`` on the middle layers alone). Each end keeps at least one layer, so what a
member receives has been through attention, not a table lookup a member could match.

The plan lists the node twice, as its first and its last stage. Both ends share its memory and
its compute: each end's load under a batched step is their sum (the pace sees the node's whole
work). Among the ends tried (``END_LAYERS`` at each side) the fastest plan wins, by the plan's
objective; ties go to the smaller ends (the members do more).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

from seamline.mesh.plan.planner import plan
from seamline.mesh.plan.pricing import range_bytes
from seamline.mesh.plan.types import (
    LinkCost,
    LinkTable,
    ModelSpec,
    NodeInfo,
    Plan,
    PlanError,
    PlanOptions,
    StageAssignment,
)

END_LAYERS = (1, 2, 3, 4, 6, 8)  # layers each end of the route may keep


def plan_private(
    model: ModelSpec,
    nodes: Sequence[NodeInfo],
    links: LinkTable | Mapping[tuple[str, str], LinkCost] | None,
    options: PlanOptions,
    own: str,
) -> Plan:
    """The fastest private plan whose ends are ``own``'s; PlanError when none fits."""
    by_id = {n.node_id: n for n in nodes}
    if own not in by_id:
        raise PlanError(f"a private mesh waits for the coordinator's own node ({own!r}) to join")
    members = [n for n in nodes if n.node_id != own]
    if not members:
        raise PlanError(
            "a private mesh needs at least one member besides the coordinator's own node"
        )
    if model.num_layers < 3:
        raise PlanError(
            f"a private mesh keeps a layer at each end and one for the members: {model.num_layers} is too few"
        )
    table = LinkTable.of(links)
    best: Plan | None = None
    for head, tail in itertools.product(END_LAYERS, END_LAYERS):
        a, b = head, model.num_layers - tail
        if b <= a or not _ends_fit(model, by_id[own], options, a, b):
            continue
        try:
            middle = plan(_middle(model, a, b), members, table, options)
        except PlanError:
            continue
        candidate = _assemble(model, by_id[own], middle, table, options, a, b)
        if best is None or _pace(candidate) < _pace(best) * (1 - 1e-9):
            best = candidate
    if best is None:
        raise PlanError(
            f"no private plan fits: the coordinator's node {own!r} cannot hold the ends "
            "with the embedding and the head, or the members cannot hold the layers between"
        )
    return best


def _ends_fit(model: ModelSpec, own: NodeInfo, options: PlanOptions, a: int, b: int) -> bool:
    first, last = (
        range_bytes(model, options, 0, a),
        range_bytes(model, options, b, model.num_layers),
    )
    return first[0] + first[1] + last[0] + last[1] <= options.capacity(own.free_memory_bytes)


def _middle(model: ModelSpec, a: int, b: int) -> ModelSpec:
    """The layers [a, b) as a model of their own: no embedding, no head."""
    cut = lambda values: tuple(values[a:b]) if values else ()  # noqa: E731
    return dataclasses.replace(
        model,
        num_layers=b - a,
        layer_bytes=cut(model.layer_bytes),
        embed_bytes=0,
        head_bytes=0,
        tied_embeddings=False,
        layer_active_bytes=cut(model.layer_active_bytes),
        layer_replicated_bytes=cut(model.layer_replicated_bytes),
        layer_window_bytes=cut(model.layer_window_bytes),
        head_load_bytes=0,
        layer_kv_bytes_per_token=cut(model.layer_kv_bytes_per_token),
        mtp_bytes=0,
        mtp_embed_bytes=0,
    )


def _assemble(
    model: ModelSpec,
    own: NodeInfo,
    middle: Plan,
    links: LinkTable,
    options: PlanOptions,
    a: int,
    b: int,
) -> Plan:
    L, rate = model.num_layers, own.bytes_per_second
    w0, kv0, read0 = range_bytes(model, options, 0, a)
    w1, kv1, read1 = range_bytes(model, options, b, L)
    both = (
        read0 + read1 - model.head_bytes + model.head_load()
    ) / rate  # the node's whole work per step
    first = StageAssignment(own.node_id, 0, a, True, False, w0, kv0, read0 / rate, load_s=both)
    last = StageAssignment(own.node_id, b, L, False, True, w1, kv1, read1 / rate, load_s=both)
    between = tuple(
        dataclasses.replace(
            s, start=s.start + a, end=s.end + a, owns_embedding=False, owns_head=False
        )
        for s in middle.stages
    )
    stages = (first, *between, last)
    frame = model.bytes_per_boundary_per_token * options.batch
    ids = [s.node_id for s in stages]
    network = float(
        sum(links.between(x, y).seconds(frame) for x, y in zip(ids, ids[1:]))
    )  # tokens return in-process
    total = sum(s.compute_s for s in stages) + network
    return Plan(
        model.name,
        L,
        stages,
        total,
        network,
        options.context_tokens,
        options.batch,
        options.objective,
        private=True,
    )


def _pace(candidate: Plan) -> float:
    return (
        candidate.slowest_stage_s()
        if candidate.objective == "throughput"
        else candidate.predicted_s_per_token
    )
