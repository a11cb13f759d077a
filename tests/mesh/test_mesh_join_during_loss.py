"""A node joining while a member is lost: the join's link measurements with the lost member end
when it is taken for lost, not after ``peer_links.PEER_TIMEOUT_S``. The joining node is what the
survivor needs to hold the model again, so every second the join waits on the dead member's
report the mesh serves nothing (`bench chaos` saw 15 s outages so, a node killed while its
restarted fellow was being measured).

Two nodes serve (memory caps under which any two, and no one, hold the model); a third starts
joining, and once the coordinator has admitted it one serving node is stopped (SIGSTOP: it
answers no measurement and no heartbeat). The stopped node is taken for lost after the heartbeat
timeout; the join then goes on at once and the survivor and the newcomer serve.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from seamline.server.demo import memory_cap_gb
from tests.support.heal import live_process, wait_until
from tests.support.mesh_harness import MeshProcesses

CONTEXT = 1024
HEARTBEAT_TIMEOUT_S = 6.0  # long enough that the join asks the stopped node before its loss
JOINED_AFTER_LOSS_S = 4.0  # the join's wait on the lost node ends with its loss (it was 15 s)


def _event_time(status: dict[str, Any], kind: str, node_id: str) -> float | None:
    """When the feed's latest event of ``kind`` about ``node_id`` came (wall time)."""
    times = [
        float(e["time"])
        for e in status["events"]
        if e["kind"] == kind and str(e["message"]).startswith(f"node {node_id} ")
    ]
    return max(times) if times else None


def _admitted(mesh: MeshProcesses, node_id: str) -> bool:
    return any(n["node_id"] == node_id for n in mesh.status()["nodes"])


def test_a_join_does_not_wait_on_a_member_that_was_lost(tmp_path: Path) -> None:
    mesh = MeshProcesses(
        tmp_path,
        nodes=2,
        node_memory_gb=memory_cap_gb(None, 2, CONTEXT),
        serve_args=("--context", str(CONTEXT), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)),
    )
    stopped = None
    try:
        mesh.start()
        mesh.wait_ready()
        victim = mesh.status()["stages"][-1]["node_id"]
        mesh.join("node2")
        wait_until(lambda: _admitted(mesh, "node2"), "node2 admitted", timeout_s=180)
        stopped = live_process(mesh, victim)
        stopped.send_signal(signal.SIGSTOP)
        wait_until(
            lambda: (
                mesh.status()["ready"]
                and "node2" in [s["node_id"] for s in mesh.status()["stages"]]
            ),
            "the survivor and node2 serving",
            timeout_s=120,
        )
        status = mesh.status()
        lost, joined = (
            _event_time(status, "node_lost", victim),
            _event_time(status, "node_joined", "node2"),
        )
        assert lost is not None and joined is not None, status["events"]
        assert joined - lost < JOINED_AFTER_LOSS_S, (
            f"node2 joined {joined - lost:.1f} s after {victim} was lost",
            "".join(mesh.output[-20:]),
        )
        answer = mesh.client().chat.completions.create(
            model="default", max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
        )
        assert answer.choices[0].message.content
    finally:
        if stopped is not None:
            stopped.kill()
        mesh.stop()
