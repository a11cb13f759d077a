"""`seamline plan`: the plan for a pool of nodes, printed, and optionally pinned in a lock file.

The pool comes from a JSON file (``--nodes FILE``, its format in ``pool_file``) or, once the
coordinator serves it, from a running mesh (``--live URL``, see ``live_pool``). A node's GPUs
hold a stage's first layers as far as they fit, the rest runs on its CPU (``plan.split``); the
table shows each stage's split, e.g. ``cuda:0 [0,16) + cpu [16,19)``.

After the table, the simulator's predictions under load (``seamline.sim.report``: tokens per
second, ms between tokens, time to first token, each stage's busy fraction at each client
count); with ``--simulate``, instead, its sweep over the pool's first n nodes and a plot.

Lock files: when ``--lock FILE`` does not exist, the new plan is written to it; when it
exists, the pinned plan is loaded and checked against the pool (same model, every node
present, every node's layers still fit) and printed with its time re-predicted for the
pool's links -- nothing is re-planned and the file is not rewritten.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from seamline.config import ModelConfig
from seamline.mesh.control.pool_file import parse_devices, parse_pool, read_pool
from seamline.mesh.plan.groups import plan_auto
from seamline.mesh.plan.planner import check_plan, price_route
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
from seamline.sim.report import Scenario, SimOptions, prediction_lines, run_sweep
from seamline.weights.loader import dtype_bytes

__all__ = ["format_plan", "live_pool", "model_spec", "parse_pool", "read_pool", "run_plan_command"]
GIB = 1 << 30


def run_plan_command(
    nodes_json_path: str | None,
    model_path: str | None,
    lock_path: str | None,
    context: int,
    batch: int,
    live_url: str | None = None,
    dtype: str = "float32",
    tensor_parallel: int = 0,
    objective: str = "throughput",
    sim: SimOptions | None = None,
) -> int:
    """Print the plan (or the checked lock) for the pool, then the simulator's predictions for it
    under ``sim``'s load (or, with ``sim.simulate``, its sweep); raise PlanError when none fits.
    ``tensor_parallel``: ranks per stage (0: lockstep groups only where no node holds a stage)."""
    if nodes_json_path is not None:
        nodes, links = read_pool(nodes_json_path)
    elif live_url is not None:
        nodes, links = live_pool(live_url)
    else:
        raise PlanError(
            "seamline plan needs a pool: --nodes FILE (JSON list of nodes) or --live URL"
        )
    spec, config = model_spec(model_path, dtype_bytes(dtype), context or None)
    options = PlanOptions(
        context_tokens=context or config.max_position_embeddings, batch=batch, objective=objective
    )
    scenario = Scenario(spec, config, tuple(nodes), links, options, tensor_parallel)
    lock = Path(lock_path) if lock_path else None
    if lock is not None and lock.exists():
        pinned = Plan.from_json(lock.read_text())
        check_plan(pinned, spec, nodes, options)
        route = [(s.node_id, s.start, s.end) for s in pinned.stages]
        print(f"locked plan from {lock} (checked against the pool; not re-planned)")
        grouped = any(s.ranks for s in pinned.stages)  # its per-rank costs are as planned
        shown = pinned if grouped else price_route(spec, nodes, links, options, route)
        print(format_plan(shown, nodes))
        _print_predictions(scenario, shown, sim or SimOptions())
        return 0
    chosen = plan_auto(spec, nodes, links, options, config, tensor_parallel)
    if live_url is not None:
        print(_current_plan(live_url, chosen))
        print("proposed plan over the live pool:")
    print(format_plan(chosen, nodes))
    if lock is not None:
        lock.write_text(chosen.to_json())
        print(f"plan written to {lock}")
    _print_predictions(scenario, chosen, sim or SimOptions())
    return 0


def _print_predictions(scenario: Scenario, plan: Plan, sim: SimOptions) -> None:
    print(
        run_sweep(scenario, sim)
        if sim.simulate
        else "\n".join(prediction_lines(scenario, plan, sim))
    )


def _live_status(coordinator_url: str) -> dict[str, Any]:
    import httpx

    url = f"{coordinator_url.rstrip('/')}/api/status"
    try:
        return dict(httpx.get(url, timeout=10).raise_for_status().json())
    except (httpx.HTTPError, ValueError) as exc:
        raise PlanError(f"cannot read the live mesh from {url}: {exc}") from None


def live_pool(coordinator_url: str) -> tuple[list[NodeInfo], LinkTable]:
    """The live mesh's nodes and links, as the coordinator's GET /api/status reports them: each
    node's link to the coordinator, and each pair's link as its nodes measured it; each node at
    the rate the coordinator plans it (its checked claim), like rates evened out as it does."""
    from seamline.mesh.plan.measured import steady_rates

    status = _live_status(coordinator_url)
    nodes = steady_rates(
        [
            NodeInfo(
                str(n["node_id"]),
                int(n["free_memory_bytes"]),
                float(n.get("planned_bytes_per_second") or n["bytes_per_second"]),
                str(n.get("address", "")),
                devices=parse_devices(n.get("devices") or [], f"node {n['node_id']}"),
            )
            for n in status.get("nodes", [])
        ]
    )
    if not nodes:
        raise PlanError(f"the mesh at {coordinator_url} has no nodes yet")
    access = {str(n["node_id"]): _status_link(n) for n in status["nodes"] if n.get("rtt_ms")}
    pairs = {
        (str(p["nodes"][0]), str(p["nodes"][1])): _status_link(p) for p in status.get("links", [])
    }
    return nodes, LinkTable(access=access, pairs=pairs)


def _current_plan(coordinator_url: str, proposed: Plan) -> str:
    """The plan the live mesh serves, and how the proposed one compares (the coordinator switches
    to a plan with a joining node when it is predicted ``GROWTH_GAIN`` times as fast)."""
    from seamline.mesh.control.planning import GROWTH_GAIN, pace

    status = _live_status(coordinator_url)
    stages = status.get("stages") or []
    if not stages:
        return f"current plan: none ({status.get('state', 'no plan')})"
    route = " -> ".join(f"{s['node_id']}[{s['layers'][0]},{s['layers'][1]})" for s in stages)
    pace_ms = status.get("pace_ms")
    line = f"current plan: {route}"
    if pace_ms:
        gain = float(pace_ms) / (pace(proposed) * 1e3)
        line += (
            f"; the proposed plan is predicted {gain:.2f}x its throughput"
            f" ({'the mesh switches' if gain >= GROWTH_GAIN else 'below'} {GROWTH_GAIN:.2f}x)"
        )
    return line


def _status_link(entry: dict[str, Any]) -> LinkCost:
    bandwidth = max(float(entry["bandwidth_mb_s"]), 0.1) * 1e6
    return LinkCost(latency_s=float(entry["rtt_ms"]) / 2e3, bandwidth_bytes_per_s=bandwidth)


def model_spec(
    model_path: str | None, dtype_bytes: int, context: int | None = None
) -> tuple[ModelSpec, ModelConfig]:
    """The planner's view of a checkpoint (exact bytes from its shapes; its multi-token-prediction
    layer on the last stage, which drafts with it as ``serve`` does by default) and its config
    (``context``: the tokens a V4 model's caches are counted for; None: its own context)."""
    from seamline.app import default_model_path
    from seamline.weights.loader import mtp_missing, open_source

    path = Path(model_path) if model_path else default_model_path()
    source = open_source(path)
    config = ModelConfig.from_hf_dict(source.config_dict())
    shapes = {name: tuple(source.shape(name)) for name in source.names()}
    name = path.stem if path.is_file() else path.resolve().name  # as `seamline package` names it
    types = {n: source.stored_type(n) for n in shapes}
    context = context or config.max_position_embeddings
    mtp = mtp_missing(source, config, embed=True) is None
    spec = ModelSpec.from_checkpoint_shapes(config, name, shapes, dtype_bytes, types, context, mtp)
    return spec, config


def format_plan(p: Plan, nodes: list[NodeInfo]) -> str:
    """A human table: one row per stage, then the predicted time per token."""
    free = {n.node_id: n.free_memory_bytes for n in nodes}
    own_device = {n.node_id: n.device for n in nodes}
    split = any(s.gpu_device for s in p.stages)  # a pool with GPUs: each stage's devices shown
    names = ["+".join(s.members()) for s in p.stages]  # a lockstep group: its ranks, leader first
    width = max(4, *(len(name) for name in names))
    rows = [
        f"plan for {p.model_name} ({p.num_layers} layers), context {p.context_tokens} x {p.batch} "
        f"sequence{'s' if p.batch > 1 else ''}",
        f"{'stage':>5}  {'node':<{width}}  {'layers':<11} {'owns':<11} {'weights':>10} "
        f"{'KV cache':>10} {'free':>10} {'compute':>11} {'under load':>11}"
        + ("  devices" if split else ""),
    ]
    for i, (s, name) in enumerate(zip(p.stages, names)):
        owns = (
            "+".join(x for x, o in (("embed", s.owns_embedding), ("head", s.owns_head)) if o) or "-"
        )
        least = min(free.get(m, 0) for m in s.members())
        rows.append(
            f"{i:>5}  {name:<{width}}  {f'[{s.start},{s.end})':<11} {owns:<11} "
            f"{_size(s.weight_bytes):>10} {_size(s.kv_bytes):>10} {_size(least):>10} "
            f"{s.compute_s * 1e3:>8.3f} ms {s.under_load_s * 1e3:>8.3f} ms"
            + (f"  {device_split(s, own_device.get(s.node_id, 'cpu'))}" if split else "")
        )
    rows.extend(p.notes)
    if any(s.ranks for s in p.stages):
        rows.append(
            "a stage of several nodes is a lockstep group: weights, KV cache and free are per rank"
        )
    rows.append(
        f"predicted {p.predicted_s_per_token * 1e3:.3f} ms/token "
        f"(network {p.network_s_per_token * 1e3:.3f} ms over {len(p.stages) - 1} hop"
        f"{'' if len(p.stages) == 2 else 's'} + return)"
        if len(p.stages) > 1
        else f"predicted {p.predicted_s_per_token * 1e3:.3f} ms/token (one node, no network)"
    )
    rows.append(_objective_line(p))
    return "\n".join(rows)


def device_split(s: StageAssignment, own_device: str = "cpu") -> str:
    """Where a stage's layers run: ``cuda:0 [0,16) + cpu [16,19)``; ``own_device`` names the node's
    own device where the plan places none."""
    return " + ".join(f"{device or own_device} [{a},{b})" for device, a, b in s.device_ranges())


def _objective_line(p: Plan) -> str:
    if p.objective == "throughput":
        slowest = p.slowest_stage_s()
        return (
            f"optimised for throughput under load: with micro-batches in flight a step takes the slowest "
            f"stage's {slowest * 1e3:.3f} ms, not the sum (per-token latency breaks ties)"
        )
    return "optimised for per-token latency (one sequence at a time)"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
