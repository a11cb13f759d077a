"""`seamline bench fuzz`'s ``claimed_resources``: a member claims ten times the speed it has,
1 TB of memory and a machine of its own (its links coming from the honest nodes' address), and
joins the serving mesh; it serves honestly. The coordinator is to plan it at no more than it
proves on its timed product, and to take the machine its address shares.

Figures: what it claimed, proved and was planned at, and its shares: ``planned_share`` (the
layers it holds in the plan the mesh serves, the largest seen while it was a member) against
``proven_share`` (its proven rate, times its core share, over the same sum for every checked
member: its share of the pool's proven speed). Target: the planned share no larger.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from seamline_bench.attack_mesh import LiveMesh, attacker, node_cap_bytes

LIAR = "shared-claimer"
CLAIMED_SPEEDUP = 10.0
CLAIMED_MEMORY_BYTES = 10**12
LOOK_EVERY_S = 1.0


def claims_more_than_it_has() -> None:
    """Its join says ten times the rate it measured, 1 TB free and a machine no one else names
    (run in the liar's process, before it joins)."""
    from seamline.mesh.node import membership

    honest = membership.local_resources

    def lying(options: Any) -> Any:
        r = honest(options)
        return r.model_copy(
            update={
                "bytes_per_second": r.bytes_per_second * CLAIMED_SPEEDUP,
                "free_memory_bytes": CLAIMED_MEMORY_BYTES,
                "host": "attacker-host",
            }
        )

    membership.local_resources = lying


def claimed_resources(
    mesh: LiveMesh, target: dict[str, Any], duration_s: float
) -> tuple[float, float, dict[str, Any]]:
    """The member joins and serves for ``duration_s`` after it is checked; then it leaves."""
    driver = attacker("liar", {**target, "mode": "claimed_resources", "node_id": LIAR}, mesh.logs)
    started = float(driver.wait_ready()["joined"])
    largest: dict[str, Any] = {}
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        seen = shares(mesh.status())
        if seen and seen["planned_share"] >= largest.get("planned_share", -1.0):
            largest = seen
        time.sleep(LOOK_EVERY_S)
    ended = time.monotonic()
    line = driver.ask("quit")
    driver.proc.wait(30)
    return started, ended, {**largest, "liar_saw": line.get("result", {})}


def shares(status: dict[str, Any]) -> dict[str, Any]:
    """The liar's figures in one status ({} until it is checked)."""
    nodes = {n["node_id"]: n for n in status.get("nodes", []) if n.get("checked")}
    liar = nodes.get(LIAR)
    if liar is None or not liar.get("proven_bytes_per_second"):
        return {}
    proven = {
        node: (n.get("proven_bytes_per_second") or 0.0) * n["core_share"]
        for node, n in nodes.items()
    }
    layers = {
        s["node_id"]: s["layers"][1] - s["layers"][0] for s in status.get("stages", [])
    }  # a private mesh's own node holds two stages: not the liar, whose share this is
    total_layers = sum(layers.values()) or 1
    planned_share = layers.get(LIAR, 0) / total_layers
    proven_share = proven[LIAR] / (sum(proven.values()) or 1.0)
    return {
        "claimed_bytes_per_second": liar["bytes_per_second"],
        "claimed_memory_bytes": liar["free_memory_bytes"],
        "proven_bytes_per_second": liar["proven_bytes_per_second"],
        "planned_bytes_per_second": liar["planned_bytes_per_second"],
        "core_share": liar["core_share"],
        "honest_core_shares": {n: v["core_share"] for n, v in nodes.items() if n != LIAR},
        "layers": layers.get(LIAR, 0),
        "stages": {n: layers[n] for n in sorted(layers)},
        "planned_share": round(planned_share, 4),
        "proven_share": round(proven_share, 4),
        "share_within_proven": planned_share <= proven_share,
    }


def liar_target(mesh: LiveMesh, invite: str, work: Path) -> dict[str, Any]:
    return {
        **mesh.target(0.0),
        "invite": invite,
        "max_memory_bytes": node_cap_bytes(),
        "cache_dir": str(work / f"cache-{LIAR}"),
    }
