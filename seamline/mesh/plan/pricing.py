"""Pricing a route: what each stage holds and reads, and the predicted time per token
(``price_route``); checking a route, and a locked plan against the live pool (``check_plan``).
Pure functions of numbers, as the planner that uses them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from seamline.mesh.plan.split import capacities, gpu_note, split_stage
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

TOKEN_ID_BYTES = 8  # per sequence, on the return hop
Route = Sequence[tuple[str, int, int]]  # (node_id, start, end) in pipeline order


def price_route(
    model: ModelSpec,
    nodes: Sequence[NodeInfo],
    links: LinkTable | Mapping[tuple[str, str], LinkCost] | None,
    options: PlanOptions,
    route: Route,
) -> Plan:
    """The Plan for an explicit route, every cost computed from scratch (no DP state)."""
    check_route(model, route)
    table = LinkTable.of(links)
    by_id = {n.node_id: n for n in nodes}
    L = model.num_layers
    stages, notes = [], []
    for node_id, s, e in route:
        if node_id not in by_id:
            raise PlanError(f"a route may name only nodes of the pool; {node_id!r} is not one")
        sizes = range_bytes(model, options, s, e)
        split = split_stage(model, options, by_id[node_id], s, e, sizes)
        stages.append(
            StageAssignment(
                node_id,
                s,
                e,
                s == 0,
                e == L,
                sizes[0],
                sizes[1],
                split.read_s,
                load_s=split.load_s,
                gpu_layers=split.gpu_layers,
                gpu_device=split.device,
                gpu_bytes=split.gpu_bytes,
            )
        )
        if split.gpu_layers == 0:
            notes.append(gpu_note(model, options, by_id[node_id], s, e))
    frame = model.bytes_per_boundary_per_token * options.batch
    ids = [n for n, _, _ in route]
    network = float(sum(table.between(a, b).seconds(frame) for a, b in zip(ids, ids[1:])))
    if len(ids) > 1:
        network += table.between(ids[-1], ids[0]).seconds(TOKEN_ID_BYTES * options.batch)
    total = sum(st.compute_s for st in stages) + network
    return Plan(
        model.name,
        L,
        tuple(stages),
        total,
        network,
        options.context_tokens,
        options.batch,
        options.objective,
        notes=tuple(notes),
    )


def range_bytes(model: ModelSpec, options: PlanOptions, s: int, e: int) -> tuple[int, int, int]:
    """(weight bytes held, KV bytes, weight bytes read per token) of owning [s, e)."""
    L = model.num_layers
    weights = sum(model.layer_bytes[s:e])
    read = sum(model.active_bytes()[s:e])
    if s == 0:
        weights += model.embed_bytes
    if e == L:
        weights += model.head_bytes + model.mtp_held(s)
        read += model.head_bytes
    if s == 0 and e == L and model.tied_embeddings:
        weights -= model.embed_bytes
    kv = sum(model.layer_kv()[s:e]) * options.context_tokens * options.batch
    return weights, kv, read


def check_route(model: ModelSpec, route: Route, private: bool = False) -> None:
    """``private``: the first and last stage are one node's (``plan.private``)."""
    if not route:
        raise PlanError("a plan has at least one stage")
    expected = 0
    for node_id, s, e in route:
        if s != expected or not s < e <= model.num_layers:
            raise PlanError(
                f"stage ranges must be contiguous, non-empty and cover [0,{model.num_layers}) "
                f"exactly once: node {node_id} has [{s},{e}) where [{expected},..) comes next"
            )
        expected = e
    if expected != model.num_layers:
        raise PlanError(f"stage ranges end at layer {expected}, not at {model.num_layers}")
    ids = [n for n, _, _ in route]
    if private and (len(ids) < 3 or ids[0] != ids[-1]):
        raise PlanError("a private route starts and ends on the same node, with a member between")
    if private:
        ids = ids[:-1]
    if len(set(ids)) != len(ids):
        raise PlanError(f"a node owns one stage at most: {sorted(ids)} repeats a node")


def check_plan(
    plan: Plan, model: ModelSpec, nodes: Sequence[NodeInfo], options: PlanOptions
) -> None:
    """Refuse a locked plan that no longer matches the model or the live pool."""
    if (plan.model_name, plan.num_layers) != (model.name, model.num_layers):
        raise PlanError(
            f"the locked plan is for model {plan.model_name!r} ({plan.num_layers} layers), "
            f"not {model.name!r} ({model.num_layers} layers)"
        )
    check_route(model, [(s.node_id, s.start, s.end) for s in plan.stages], plan.private)
    members = [m for st in plan.loaded_stages() for m in st.members()]
    if len(set(members)) != len(members):
        raise PlanError(f"a node belongs to one stage at most: {sorted(members)} repeats a node")
    by_id = {n.node_id: n for n in nodes}
    for st in plan.stages:
        for member in st.members():
            node = by_id.get(member)
            if node is None:
                raise PlanError(
                    f"the locked plan needs node {member!r}, which is not in the pool "
                    f"({', '.join(sorted(by_id)) or 'empty'})"
                )
            # a group's bytes are per rank, as planned (in system memory); a single node's are recomputed
            sizes = (
                range_bytes(model, options, st.start, st.end)
                if not st.ranks
                else (st.weight_bytes, st.kv_bytes, 0)
            )
            plain = replace(node, devices=()) if st.ranks else node
            if not split_stage(model, options, plain, st.start, st.end, sizes).fits:
                cpu, gpu = capacities(plain, options)
                on_gpu = f" (and {gpu} on its {plain.devices[0].device})" if plain.devices else ""
                raise PlanError(
                    f"node {member!r} no longer fits its locked layers [{st.start},{st.end}): "
                    f"they need {sizes[0] + sizes[1]} bytes, it has {cpu} after headroom{on_gpu}"
                )
