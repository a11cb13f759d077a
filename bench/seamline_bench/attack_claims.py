"""`seamline bench fuzz`'s ``claimed_resources``: a member claims ten times the speed it has,
1 TB of memory and a machine of its own (its links coming from the honest nodes' address), and
joins the serving mesh; it serves honestly. The coordinator is to plan it at no more than it
proves on its timed product, and to take the machine its address shares.

Figures: what it claimed, proved and was planned at, and its shares of the route the mesh
serves (the largest seen while it was a member; 0 while it is not in the route):
``planned_share``, its planned rate over the route's planned rates (what the planner was told),
against ``proven_share``, its proven rate over theirs (each times its core share). Target: the
planned share no larger. They are equal when every node is planned at its proof, as the liar
is; an honest node that claimed less than 1.2x its proof is planned at its claim, which lifts
the liar's planned share a little: its claim, not the liar's. ``layer_share``: its layers over
the model's; ``pool_proven_share``: its share of every checked member's proven speed.
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
    layers = {s["node_id"]: s["layers"][1] - s["layers"][0] for s in status.get("stages", [])}
    route = [node for node in layers if node in nodes]
    planned = {node: float(nodes[node]["planned_bytes_per_second"]) for node in route}
    proven = {
        node: float(nodes[node].get("proven_bytes_per_second") or 0.0) * nodes[node]["core_share"]
        for node in route
    }
    pooled = {
        n: float(v.get("proven_bytes_per_second") or 0.0) * v["core_share"]
        for n, v in nodes.items()
    }
    planned_share = planned.get(LIAR, 0.0) / (sum(planned.values()) or 1.0)
    proven_share = proven.get(LIAR, 0.0) / (sum(proven.values()) or 1.0)
    return {
        "claimed_bytes_per_second": liar["bytes_per_second"],
        "claimed_memory_bytes": liar["free_memory_bytes"],
        "proven_bytes_per_second": liar["proven_bytes_per_second"],
        "planned_bytes_per_second": liar["planned_bytes_per_second"],
        "core_share": liar["core_share"],
        "honest": {
            n: {
                "claimed": v["bytes_per_second"],
                "proven": v.get("proven_bytes_per_second"),
                "planned": v["planned_bytes_per_second"],
                "core_share": v["core_share"],
            }
            for n, v in nodes.items()
            if n != LIAR
        },
        "stages": {n: layers[n] for n in sorted(layers)},
        "layer_share": round(layers.get(LIAR, 0) / (sum(layers.values()) or 1), 4),
        "planned_share": round(planned_share, 4),
        "proven_share": round(proven_share, 4),
        "pool_proven_share": round(pooled[LIAR] / (sum(pooled.values()) or 1.0), 4),
        "share_within_proven": planned_share <= proven_share * (1 + 1e-9),
    }


def liar_target(mesh: LiveMesh, invite: str, work: Path) -> dict[str, Any]:
    return {
        **mesh.target(0.0),
        "invite": invite,
        "max_memory_bytes": node_cap_bytes(),
        "cache_dir": str(work / f"cache-{LIAR}"),
    }
