"""A plan as the simulator sees it (``route_of``), and what the simulator predicts for it (``predict``).

Each stage is one ``StageCost``: the weight bytes it reads per row (its layers' active bytes and,
on the last stage, the head's: ``range_bytes``), at its node's measured speeds (the one-row rate
and the speed probe's batched rates from the pool file). Links are the pool's, between
consecutive stages, then the return hop from the last stage to the first.

A stage split over a GPU and its CPU (``plan.split``) takes the GPU part's step plus the CPU
part's step. One StageCost carries that sum: its speed at every probed row count r of either
device is ``B / (B_gpu / gpu.rate(r) + B_cpu / cpu.rate(r))`` (B = B_gpu + B_cpu, its bytes
read per row), exact at those counts and interpolated between them like any device's speed.

A lockstep group's stage reads one rank's share (``groups.group_spec``) at its slowest member's
speed, with two gates per layer over its slowest member pair's link. Routed experts are not
counted apart (the spec does not carry their count): a Mixture-of-Experts stage reads its
active bytes at every row count. Pure Python, no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from seamline.mesh.plan.groups import group_spec
from seamline.mesh.plan.pricing import range_bytes
from seamline.mesh.plan.types import (
    FRAME_DTYPE_BYTES,
    LinkCost,
    LinkTable,
    ModelSpec,
    NodeInfo,
    Plan,
    PlanOptions,
    StageAssignment,
)
from seamline.sim.costs import DeviceSpeed, FrontCost, Load, StageCost

if TYPE_CHECKING:  # the simulator needs simpy: imported where it runs
    from seamline.sim.simulate import Pipeline, SimResult

GATES_PER_LAYER = (
    2  # a lockstep group sums partial results after attention and after the feed-forward
)


def node_speed(node: NodeInfo, device: str = "") -> DeviceSpeed:
    """The speed of ``node``'s CPU, or of its accelerator named ``device``."""
    for d in node.devices:
        if device and d.device == device:
            return DeviceSpeed(d.bytes_per_second, dict(d.batched_bytes_per_second))
    return DeviceSpeed(node.bytes_per_second, dict(node.batched_bytes_per_second))


def combined_speed(parts: Sequence[tuple[float, DeviceSpeed]]) -> DeviceSpeed:
    """One speed for reading each part's bytes on its own device, one part after the other."""
    parts = [(b, s) for b, s in parts if b > 0]
    if len(parts) == 1:
        return parts[0][1]
    total = sum(b for b, _ in parts)

    def rate(rows: int) -> float:
        return total / sum(b / s.rate(rows) for b, s in parts)

    counts = sorted({r for _, s in parts for r in s.batched if r > 1})
    return DeviceSpeed(rate(1), {r: rate(r) for r in counts})


def _stage_speed(
    stage: StageAssignment, node: NodeInfo, model: ModelSpec, read: float
) -> DeviceSpeed:
    if not stage.gpu_device:
        return node_speed(node)
    if stage.gpu_layers is None:  # all of it on the accelerator
        return node_speed(node, stage.gpu_device)
    on_gpu = float(sum(model.active_bytes()[stage.start : stage.start + stage.gpu_layers]))
    return combined_speed(
        [(on_gpu, node_speed(node, stage.gpu_device)), (read - on_gpu, node_speed(node))]
    )


def _group_stage(
    stage: StageAssignment,
    model: ModelSpec,
    by_id: dict[str, NodeInfo],
    table: LinkTable,
    options: PlanOptions,
    frame: int,
) -> StageCost:
    members = [by_id[m] for m in stage.ranks]
    slowest = min(members, key=lambda n: n.bytes_per_second)
    read = range_bytes(group_spec(model, len(members), False), options, stage.start, stage.end)[2]
    gate_row = model.hidden_size * FRAME_DTYPE_BYTES
    pairs = [table.between(a.node_id, b.node_id) for a, b in itertools.combinations(members, 2)]
    link = max(
        pairs, key=lambda c: c.seconds(16 * gate_row)
    )  # the slowest pair holds every gate up
    fails = [n.fails_at_s for n in members if n.fails_at_s is not None]
    return StageCost(
        "+".join(stage.ranks),
        node_speed(slowest),
        read,
        frame_bytes_per_row=frame,
        ranks=len(members),
        gates=GATES_PER_LAYER * (stage.end - stage.start),
        gate_bytes_per_row=gate_row,
        gate_link=link,
        fails_at_s=min(fails, default=None),
    )


def stage_costs(
    plan: Plan, model: ModelSpec, nodes: Sequence[NodeInfo], links: LinkTable
) -> tuple[StageCost, ...]:
    """Each stage of ``plan`` as the cost model sees it (module doc)."""
    by_id = {n.node_id: n for n in nodes}
    options = PlanOptions(context_tokens=plan.context_tokens, batch=plan.batch)
    costs = []
    for i, stage in enumerate(plan.stages):
        frame = model.bytes_per_boundary_per_token if i < len(plan.stages) - 1 else 0
        if stage.ranks:
            costs.append(_group_stage(stage, model, by_id, links, options, frame))
            continue
        node = by_id[stage.node_id]
        read = float(range_bytes(model, options, stage.start, stage.end)[2])
        costs.append(
            StageCost(
                stage.node_id,
                _stage_speed(stage, node, model, read),
                read,
                frame_bytes_per_row=frame,
                fails_at_s=node.fails_at_s,
            )
        )
    return tuple(costs)


def route_of(
    plan: Plan, model: ModelSpec, nodes: Sequence[NodeInfo], links: LinkTable | None
) -> Pipeline:
    """The simulator's ``Pipeline`` for ``plan`` over the pool ``nodes`` and ``links``."""
    from seamline.sim.simulate import Pipeline

    table = LinkTable.of(links)
    ids = plan.node_ids()
    hops: list[LinkCost] = [table.between(a, b) for a, b in zip(ids, ids[1:])]
    if len(ids) > 1:
        hops.append(table.between(ids[-1], ids[0]))  # the drawn tokens back to stage 0
    return Pipeline(stage_costs(plan, model, nodes, table), tuple(hops))


def predict_many(
    plan: Plan,
    model: ModelSpec,
    nodes: Sequence[NodeInfo],
    links: LinkTable | None,
    clients: Sequence[int],
    prompt_tokens: int,
    output_tokens: int,
    front: FrontCost | None = None,
    after_failure: Plan | None = None,
) -> list[dict[str, Any]]:
    """``predict`` at each client count of ``clients``, the single-stream run simulated once."""
    from seamline.sim.simulate import simulate

    route = route_of(plan, model, nodes, links)
    survivors = [
        replace(n, fails_at_s=None) for n in nodes
    ]  # the simulator replans once: no second failure
    after = route_of(after_failure, model, survivors, links) if after_failure is not None else None
    runs: dict[int, SimResult] = {}

    def run(count: int) -> SimResult:
        if count not in runs:
            load = Load(count, prompt_tokens, output_tokens)
            runs[count] = simulate(route, load, front=front or FrontCost(), after_failure=after)
        return runs[count]

    names = tuple(s.name for s in route.stages)
    out = []
    for count in clients:
        result = run(count)
        busy = tuple(float(b) for b in result.busy)
        out.append(
            {
                "clients": count,
                "single_ms_per_token": float(run(1).p50_ms_between_tokens()),
                "tok_s": float(result.tok_s),
                "ttft_s": float(result.p50_ttft_s()),
                "ms_between_tokens": float(result.p50_ms_between_tokens()),
                "busy": busy,
                "stages": names,
                "bottleneck": names[max(range(len(busy)), key=busy.__getitem__)] if busy else "",
                "replayed": int(result.replayed),
                "wall_s": float(result.wall_s),
            }
        )
    return out


def predict(
    plan: Plan,
    model: ModelSpec,
    nodes: Sequence[NodeInfo],
    links: LinkTable | None,
    clients: int,
    prompt_tokens: int,
    output_tokens: int,
    front: FrontCost | None = None,
    after_failure: Plan | None = None,
) -> dict[str, Any]:
    """What the simulator predicts for ``plan`` under ``clients`` clients starting together, each
    streaming one request of ``prompt_tokens`` and ``output_tokens``: ``single_ms_per_token``
    (one client alone), ``tok_s`` (all of them), ``ttft_s`` (p50 time to first token),
    ``ms_between_tokens`` (p50), ``busy`` (each stage's busy fraction, named in ``stages``),
    ``bottleneck`` (the busiest stage), ``replayed`` (requests replayed after a failure:
    ``after_failure`` is the plan the mesh switches to when a member with ``fails_at_s`` fails)."""
    return predict_many(
        plan, model, nodes, links, [clients], prompt_tokens, output_tokens, front, after_failure
    )[0]
