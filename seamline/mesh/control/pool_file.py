"""The pool file of `seamline plan --nodes FILE`: nodes and their links, strictly checked.

The file is a list of nodes, or an object ``{"nodes": [...], "links": [...]}`` when some pairs
of nodes have a link of their own::

    [{"node_id": "a", "free_memory_gb": 8, "bytes_per_second": 2e10,
      "latency_ms": 0.25, "bandwidth_mbps": 1000}, ...]
    "links": [{"a": "a", "b": "c", "latency_ms": 40, "bandwidth_mbps": 50}]

``free_memory_gb`` is in GiB (2**30 bytes; ``free_memory_bytes`` may be given instead);
``bytes_per_second`` is the node's measured weight-streaming rate. ``latency_ms`` (one-way)
and ``bandwidth_mbps`` (megabits per second) describe the node's own link: a pair of nodes
is as slow as its slower end unless ``links`` names the pair, and a link names only nodes
the file declares. ``address`` and ``device`` are optional and informational. A node's GPUs
are an optional list, the one it computes on first; the top-level memory and rate stay its
system memory and its CPU's::

    "devices": [{"device": "cuda:0", "free_memory_gb": 24, "bytes_per_second": 1.5e12}]

For the simulator (`seamline plan` predictions, ``--simulate``), optionally: per node and per
device ``"batched_bytes_per_second": {"16": x, "64": y}``, the speed probe's rate at that many
rows (weight bytes x rows per second; without it a step of many rows is priced at the one-row
rate), and per node ``"fails_at_s"``, the second of the simulated run at which it fails. The
planner reads neither.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from seamline.mesh.plan.types import (
    DEFAULT_LINK,
    DeviceInfo,
    LinkCost,
    LinkTable,
    NodeInfo,
    PlanError,
)

GIB = 1 << 30
BATCHED = "batched_bytes_per_second"
NODE_KEYS = {
    "node_id",
    "free_memory_gb",
    "free_memory_bytes",
    "bytes_per_second",
    "latency_ms",
    "bandwidth_mbps",
    "address",
    "device",
    "devices",
    BATCHED,
    "fails_at_s",
}
DEVICE_KEYS = {"device", "free_memory_gb", "free_memory_bytes", "bytes_per_second", BATCHED}
MAX_DEVICES = 16
MAX_BATCHED_POINTS = 16
LINK_KEYS = {"a", "b", "latency_ms", "bandwidth_mbps"}


def read_pool(path: str) -> tuple[list[NodeInfo], LinkTable]:
    """The pool in the file at ``path``; its links name only the nodes it declares."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"the nodes file {path} must be readable JSON ({exc})") from None
    return parse_pool(data, path, strict_links=True)


def parse_pool(
    data: Any, where: str = "the nodes file", strict_links: bool = False
) -> tuple[list[NodeInfo], LinkTable]:
    """Nodes and links from the JSON described in the module docstring, strictly checked.
    ``strict_links``: refuse a link naming a node the pool does not declare (a file's pool);
    else such a link is kept for a node that may join later."""
    if isinstance(data, dict) and set(data) <= {"nodes", "links"}:
        items, pairs = data.get("nodes"), data.get("links") or []
    else:
        items, pairs = data, []
    if not isinstance(items, list) or not items or not isinstance(pairs, list):
        raise PlanError(f"{where} must be a non-empty JSON list of nodes, or an object with one")
    nodes, access = [], {}
    for i, item in enumerate(items):
        node, link = _parse_node(
            _object(item, NODE_KEYS, f"{where}: node {i}"), f"{where}: node {i}"
        )
        nodes.append(node)
        if link is not None:
            access[node.node_id] = link
    declared = [n.node_id for n in nodes]
    links = {}
    for i, item in enumerate(pairs):
        obj = _object(item, LINK_KEYS, f"{where}: link {i}")
        if not all(isinstance(obj.get(k), str) for k in ("a", "b")):
            raise PlanError(f"{where}: link {i} needs node ids a and b")
        unknown = [obj[k] for k in ("a", "b") if obj[k] not in declared]
        if strict_links and unknown:
            raise PlanError(
                f"{where}: link {i} names node {unknown[0]!r}, which the pool does not declare "
                f"({', '.join(declared)})"
            )
        links[(str(obj["a"]), str(obj["b"]))] = _link(obj, f"{where}: link {i}", DEFAULT_LINK)
    return nodes, LinkTable(access=access, pairs=links)


def _object(item: Any, allowed: set[str], where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise PlanError(f"{where} must be a JSON object")
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise PlanError(
            f"{where} has unknown field {unknown[0]!r} (known: {', '.join(sorted(allowed))})"
        )
    return item


def _parse_node(obj: dict[str, Any], where: str) -> tuple[NodeInfo, LinkCost | None]:
    if not isinstance(obj.get("node_id"), str) or not obj["node_id"]:
        raise PlanError(f"{where} needs a non-empty string node_id")
    where = f"{where} ({obj['node_id']})"
    free, rate = _memory_and_rate(obj, where)
    has_link = "latency_ms" in obj or "bandwidth_mbps" in obj
    link = _link(obj, where, DEFAULT_LINK) if has_link else None
    address, device = str(obj.get("address", "")), str(obj.get("device", "cpu"))
    devices = parse_devices(obj.get("devices", []), where)
    fails = _number(obj, "fails_at_s", where) if "fails_at_s" in obj else None
    node = NodeInfo(
        obj["node_id"], int(free), rate, address, device, devices, batched_rates(obj, where), fails
    )
    return node, link


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


def batched_rates(obj: dict[str, Any], where: str) -> tuple[tuple[int, float], ...]:
    """``batched_bytes_per_second`` of a node or a device: {"rows": rate}, rows a positive
    integer written as a string (JSON keys are strings), each rate > 0; () when absent."""
    table = obj.get(BATCHED, {})
    if not isinstance(table, dict) or len(table) > MAX_BATCHED_POINTS:
        raise PlanError(
            f"{where} needs {BATCHED} as an object of at most {MAX_BATCHED_POINTS} "
            f'row counts, e.g. {{"16": 3e11, "64": 9e11}}'
        )
    points = []
    for key in table:
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) > 0):
            raise PlanError(
                f"{where} needs each {BATCHED} key to be a row count (a positive integer "
                f'such as "16"), not {key!r}'
            )
        value = _number(table, key, f"{where}: {BATCHED}")
        if value <= 0:
            raise PlanError(f"{where}: {BATCHED} needs {key} > 0, not {value!r}")
        points.append((int(key), value))
    return tuple(sorted(points))


def parse_devices(items: Any, where: str) -> tuple[DeviceInfo, ...]:
    """A node's GPUs: each a name (not "cpu": system memory is the node's own fields), its free
    memory and its weight-streaming rate (and its batched rates, for the simulator)."""
    if not isinstance(items, list) or len(items) > MAX_DEVICES:
        raise PlanError(f"{where}: devices must be a list of at most {MAX_DEVICES} objects")
    devices = []
    for i, item in enumerate(items):
        obj = _object(item, DEVICE_KEYS, f"{where}: device {i}")
        name = obj.get("device")
        if not isinstance(name, str) or not name or name.strip().lower() == "cpu":
            raise PlanError(
                f"{where}: device {i} needs a name such as cuda:0 (the CPU is the node's own fields)"
            )
        free, rate = _memory_and_rate(obj, f"{where}: device {name}")
        devices.append(
            DeviceInfo(name, int(free), rate, batched_rates(obj, f"{where}: device {name}"))
        )
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
