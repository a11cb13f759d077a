"""What a member claims is checked: a member that claims ten times the speed it has, 1 TB of
memory and a machine of its own is planned at the rate it proves on the coordinator's timed
product, shares the CPUs of the nodes its link's address shares, and gets no more than its
share of the layers (a fraction of them, rather than the 24 of 30 a believed claim took).

The mesh runs over loopback: the coordinator and two honest nodes are `seamline` processes;
the liar is a real ``Node`` run in this process (its links are real), its join changed as a
liar would change it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from seamline.mesh.node import membership
from seamline.mesh.node.process import Node, NodeOptions
from seamline.mesh.plan.measured import PROVEN_ALLOWANCE
from seamline.mesh.protocol.invite import Invite
from seamline.server.demo import memory_cap_gb
from tests.support.mesh_harness import MeshProcesses

CONTEXT = 1024
LIAR = "liar0"
CLAIMED_SPEEDUP = 10.0


def _claims_too_much(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its join says ten times the rate it measured, 1 TB free and a machine no one else names."""
    honest = membership.local_resources

    def lying(options: NodeOptions) -> object:
        r = honest(options)
        return r.model_copy(
            update={
                "bytes_per_second": r.bytes_per_second * CLAIMED_SPEEDUP,
                "free_memory_bytes": 10**12,
                "host": "a-machine-of-its-own",
            }
        )

    monkeypatch.setattr(membership, "local_resources", lying)


def _planned(mesh: MeshProcesses, timeout_s: float = 120) -> dict:
    """The status once a plan is chosen (what the planner was told is all this test reads: the
    stages need not load)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = mesh.status()
        if status["stages"]:
            return dict(status)
        time.sleep(0.25)
    raise AssertionError(f"no plan was made: {mesh.status_or_output()}")


def test_a_member_claiming_ten_times_its_speed_is_planned_at_its_proven_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = memory_cap_gb(None, 2, CONTEXT)
    mesh = MeshProcesses(
        tmp_path, nodes=3, node_memory_gb=cap, serve_args=("--context", str(CONTEXT))
    ).start(join=False)
    try:
        _claims_too_much(monkeypatch)
        options = NodeOptions(
            max_memory_bytes=int(cap * (1 << 30)),
            node_id=LIAR,
            cache_dir=tmp_path / LIAR,
            progress=False,
        )
        liar = Node(Invite.decode(mesh.token), options)
        liar.join()
        threading.Thread(target=liar.serve, daemon=True).start()
        mesh.join("node1")
        mesh.join("node2")
        status = _planned(mesh)
        nodes = {n["node_id"]: n for n in status["nodes"]}
        lied = nodes[LIAR]
        assert lied["bytes_per_second"] > 5 * lied["proven_bytes_per_second"], lied
        share = lied["core_share"]
        assert share == pytest.approx(nodes["node1"]["core_share"])  # its address is theirs
        assert lied["planned_bytes_per_second"] <= (
            PROVEN_ALLOWANCE * lied["proven_bytes_per_second"] * share * 1.001
        ), lied
        layers = {s["node_id"]: s["layers"][1] - s["layers"][0] for s in status["stages"]}
        # A third is 10 of 30; a proof timed on a busy machine moves that a little, never to the
        # 24 of 30 a believed claim took.
        assert layers.get(LIAR, 0) <= 20, (layers, nodes)
    finally:
        mesh.stop()
