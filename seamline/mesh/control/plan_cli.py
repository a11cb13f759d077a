"""`seamline plan`: the plan for a pool of nodes, printed, and optionally pinned in a lock file.

The pool comes from a JSON file (``--nodes FILE``) or, once the coordinator serves it, from a
running mesh (``--live URL``, see ``live_pool``). The file is a list of nodes, or an object
``{"nodes": [...], "links": [...]}`` when some pairs of nodes have a link of their own::

    [{"node_id": "a", "free_memory_gb": 8, "bytes_per_second": 2e10,
      "latency_ms": 0.25, "bandwidth_mbps": 1000}, ...]
    "links": [{"a": "a", "b": "c", "latency_ms": 40, "bandwidth_mbps": 50}]

``free_memory_gb`` is in GiB (2**30 bytes; ``free_memory_bytes`` may be given instead);
``bytes_per_second`` is the node's measured weight-streaming rate. ``latency_ms`` (one-way)
and ``bandwidth_mbps`` (megabits per second) describe the node's own link: a pair of nodes
is as slow as its slower end unless ``links`` names the pair. ``address`` and ``device``
are optional and informational. A node's GPUs are an optional list, the one it computes on
first; the top-level memory and rate stay its system memory and its CPU's::

    "devices": [{"device": "cuda:0", "free_memory_gb": 24, "bytes_per_second": 1.5e12}]

A stage's first layers then go on that GPU as far as they fit, the rest on the CPU
(``plan.split``); the table shows each stage's split, e.g. ``cuda:0 [0,16) + cpu [16,19)``.

Lock files: when ``--lock FILE`` does not exist, the new plan is written to it; when it
exists, the pinned plan is loaded and checked against the pool (same model, every node
present, every node's layers still fit) and printed with its time re-predicted for the
pool's links -- nothing is re-planned and the file is not rewritten.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from seamline.config import ModelConfig
from seamline.mesh.plan.groups import plan_auto
from seamline.mesh.plan.planner import check_plan, price_route
from seamline.mesh.plan.types import (
    DEFAULT_LINK,
    DeviceInfo,
    LinkCost,
    LinkTable,
    ModelSpec,
    NodeInfo,
    Plan,
    PlanError,
    PlanOptions,
    StageAssignment,
)
from seamline.weights.loader import dtype_bytes

GIB = 1 << 30
NODE_KEYS = {"node_id", "free_memory_gb", "free_memory_bytes", "bytes_per_second", "latency_ms",
             "bandwidth_mbps", "address", "device", "devices"}  # fmt: skip
DEVICE_KEYS = {"device", "free_memory_gb", "free_memory_bytes", "bytes_per_second"}
MAX_DEVICES = 16
LINK_KEYS = {"a", "b", "latency_ms", "bandwidth_mbps"}


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
) -> int:
    """Print the plan (or the checked lock) for the pool; raise PlanError when none fits.
    ``tensor_parallel``: ranks per stage (0: lockstep groups only where no node holds a stage)."""
    if nodes_json_path is not None:
        nodes, links = read_pool(nodes_json_path)
    elif live_url is not None:
        nodes, links = live_pool(live_url)
    else:
        raise PlanError("seamline plan needs a pool: --nodes FILE (JSON list of nodes) or --live URL")
    spec, config = model_spec(model_path, dtype_bytes(dtype), context or None)
    options = PlanOptions(context_tokens=context or config.max_position_embeddings, batch=batch, objective=objective)
    lock = Path(lock_path) if lock_path else None
    if lock is not None and lock.exists():
        pinned = Plan.from_json(lock.read_text())
        check_plan(pinned, spec, nodes, options)
        route = [(s.node_id, s.start, s.end) for s in pinned.stages]
        print(f"locked plan from {lock} (checked against the pool; not re-planned)")
        grouped = any(s.ranks for s in pinned.stages)  # its per-rank costs are as planned
        print(format_plan(pinned if grouped else price_route(spec, nodes, links, options, route), nodes))
        return 0
    chosen = plan_auto(spec, nodes, links, options, config, tensor_parallel)
    if live_url is not None:
        print(_current_plan(live_url, chosen))
        print("proposed plan over the live pool:")
    print(format_plan(chosen, nodes))
    if lock is not None:
        lock.write_text(chosen.to_json())
        print(f"plan written to {lock}")
    return 0


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
    nodes = steady_rates([NodeInfo(str(n["node_id"]), int(n["free_memory_bytes"]),
                                   float(n.get("planned_bytes_per_second") or n["bytes_per_second"]),
                                   str(n.get("address", "")),
                                   devices=_parse_devices(n.get("devices") or [], f"node {n['node_id']}"))
                          for n in status.get("nodes", [])])  # fmt: skip
    if not nodes:
        raise PlanError(f"the mesh at {coordinator_url} has no nodes yet")
    access = {str(n["node_id"]): _status_link(n) for n in status["nodes"] if n.get("rtt_ms")}
    pairs = {(str(p["nodes"][0]), str(p["nodes"][1])): _status_link(p) for p in status.get("links", [])}
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
        line += (f"; the proposed plan is predicted {gain:.2f}x its throughput"
                 f" ({'the mesh switches' if gain >= GROWTH_GAIN else 'below'} {GROWTH_GAIN:.2f}x)")  # fmt: skip
    return line


def _status_link(entry: dict[str, Any]) -> LinkCost:
    return LinkCost(latency_s=float(entry["rtt_ms"]) / 2e3, bandwidth_bytes_per_s=max(float(entry["bandwidth_mb_s"]), 0.1) * 1e6)


def model_spec(model_path: str | None, dtype_bytes: int, context: int | None = None) -> tuple[ModelSpec, ModelConfig]:
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


def read_pool(path: str) -> tuple[list[NodeInfo], LinkTable]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"the nodes file {path} must be readable JSON ({exc})") from None
    return parse_pool(data, path)


def parse_pool(data: Any, where: str = "the nodes file") -> tuple[list[NodeInfo], LinkTable]:
    """Nodes and links from the JSON described in the module docstring, strictly checked."""
    if isinstance(data, dict) and set(data) <= {"nodes", "links"}:
        items, pairs = data.get("nodes"), data.get("links") or []
    else:
        items, pairs = data, []
    if not isinstance(items, list) or not items or not isinstance(pairs, list):
        raise PlanError(f"{where} must be a non-empty JSON list of nodes, or an object with one")
    nodes, access = [], {}
    for i, item in enumerate(items):
        node, link = _parse_node(_object(item, NODE_KEYS, f"{where}: node {i}"), f"{where}: node {i}")
        nodes.append(node)
        if link is not None:
            access[node.node_id] = link
    links = {}
    for i, item in enumerate(pairs):
        obj = _object(item, LINK_KEYS, f"{where}: link {i}")
        if not all(isinstance(obj.get(k), str) for k in ("a", "b")):
            raise PlanError(f"{where}: link {i} needs node ids a and b")
        links[(str(obj["a"]), str(obj["b"]))] = _link(obj, f"{where}: link {i}", DEFAULT_LINK)
    return nodes, LinkTable(access=access, pairs=links)


def _object(item: Any, allowed: set[str], where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise PlanError(f"{where} must be a JSON object")
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise PlanError(f"{where} has unknown field {unknown[0]!r} (known: {', '.join(sorted(allowed))})")
    return item


def _parse_node(obj: dict[str, Any], where: str) -> tuple[NodeInfo, LinkCost | None]:
    if not isinstance(obj.get("node_id"), str) or not obj["node_id"]:
        raise PlanError(f"{where} needs a non-empty string node_id")
    where = f"{where} ({obj['node_id']})"
    free, rate = _memory_and_rate(obj, where)
    has_link = "latency_ms" in obj or "bandwidth_mbps" in obj
    link = _link(obj, where, DEFAULT_LINK) if has_link else None
    address, device = str(obj.get("address", "")), str(obj.get("device", "cpu"))
    devices = _parse_devices(obj.get("devices", []), where)
    return NodeInfo(obj["node_id"], int(free), rate, address, device, devices), link


def _memory_and_rate(obj: dict[str, Any], where: str) -> tuple[float, float]:
    if ("free_memory_gb" in obj) == ("free_memory_bytes" in obj):
        raise PlanError(f"{where} needs exactly one of free_memory_gb and free_memory_bytes")
    if "free_memory_bytes" in obj:
        free = _number(obj, "free_memory_bytes", where)
    else:
        free = _number(obj, "free_memory_gb", where) * GIB
    rate = _number(obj, "bytes_per_second", where)
    if rate <= 0:
        raise PlanError(f"{where} needs bytes_per_second > 0")
    return free, rate


def _parse_devices(items: Any, where: str) -> tuple[DeviceInfo, ...]:
    """A node's GPUs: each a name (not "cpu": system memory is the node's own fields), its free
    memory and its weight-streaming rate."""
    if not isinstance(items, list) or len(items) > MAX_DEVICES:
        raise PlanError(f"{where}: devices must be a list of at most {MAX_DEVICES} objects")
    devices = []
    for i, item in enumerate(items):
        obj = _object(item, DEVICE_KEYS, f"{where}: device {i}")
        name = obj.get("device")
        if not isinstance(name, str) or not name or name.strip().lower() == "cpu":
            raise PlanError(f"{where}: device {i} needs a name such as cuda:0 (the CPU is the node's own fields)")
        free, rate = _memory_and_rate(obj, f"{where}: device {name}")
        devices.append(DeviceInfo(name, int(free), rate))
    names = [d.device for d in devices]
    if len(set(names)) != len(names):
        raise PlanError(f"{where}: each device is listed once, not {names}")
    return tuple(devices)


def _link(obj: dict[str, Any], where: str, default: LinkCost) -> LinkCost:
    latency, bandwidth = default.latency_s, default.bandwidth_bytes_per_s
    if "latency_ms" in obj:
        latency = _number(obj, "latency_ms", where) / 1e3
    if "bandwidth_mbps" in obj:
        bandwidth = _number(obj, "bandwidth_mbps", where) * 1e6 / 8  # megabits -> bytes
    if bandwidth <= 0:
        raise PlanError(f"{where} needs bandwidth_mbps > 0")
    return LinkCost(latency, bandwidth)


def _number(obj: dict[str, Any], key: str, where: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise PlanError(f"{where} needs {key} as a non-negative finite number, not {value!r}")
    return float(value)


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
        f"{'KV cache':>10} {'free':>10} {'compute':>11} {'under load':>11}" + ("  devices" if split else ""),
    ]
    for i, (s, name) in enumerate(zip(p.stages, names)):
        owns = "+".join(x for x, o in (("embed", s.owns_embedding), ("head", s.owns_head)) if o) or "-"
        least = min(free.get(m, 0) for m in s.members())
        rows.append(
            f"{i:>5}  {name:<{width}}  {f'[{s.start},{s.end})':<11} {owns:<11} "
            f"{_size(s.weight_bytes):>10} {_size(s.kv_bytes):>10} {_size(least):>10} "
            f"{s.compute_s * 1e3:>8.3f} ms {s.under_load_s * 1e3:>8.3f} ms"
            + (f"  {device_split(s, own_device.get(s.node_id, 'cpu'))}" if split else "")
        )
    rows.extend(p.notes)
    if any(s.ranks for s in p.stages):
        rows.append("a stage of several nodes is a lockstep group: weights, KV cache and free are per rank")
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
        return (f"optimised for throughput under load: with micro-batches in flight a step takes the slowest "
                f"stage's {slowest * 1e3:.3f} ms, not the sum (per-token latency breaks ties)")  # fmt: skip
    return "optimised for per-token latency (one sequence at a time)"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
