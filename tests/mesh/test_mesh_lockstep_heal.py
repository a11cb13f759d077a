"""No request lost in a mesh of lockstep groups: 2 stages x 2 ranks plus a standby.

A rank killed (SIGKILL) mid-answer, or stopped (SIGSTOP) so that its group's gate times out
before any heartbeat is missed: the group is formed again with the standby in the lost rank's
place, and four streams at once (three greedy, one seeded) end with the text they have
without the failure. Heartbeats are set long here (60 s), so the stopped rank is caught by
the gate timeout (3 s) alone.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from seamline.server.demo import memory_cap_gb
from tests.support.heal import (
    REQUESTS,
    fail_mid_streams,
    live_process,
    stream_request,
    wait_until,
)
from tests.support.mesh_harness import MeshProcesses
from tests.support.moe_folder import CONTEXT, build_moe_folder

NODES = 5


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    root = tmp_path_factory.mktemp("lockstep-heal")
    folder = build_moe_folder(root / "moe")
    mesh = MeshProcesses(
        root,
        nodes=NODES,
        model=str(folder),
        node_memory_gb=memory_cap_gb(str(folder), 2, CONTEXT, ranks=2),
        serve_args=(
            "--context",
            str(CONTEXT),
            "--tensor-parallel",
            "2",
            "--gate-timeout",
            "3",
            "--heartbeat-timeout",
            "60",
            "--replay-deadline",
            "280",
        ),
    )  # 5 nodes on 2 shared cores reload slowly
    try:
        mesh.start()
        mesh.wait_ready()
        yield mesh
    finally:
        for proc in mesh.node_procs:
            proc.send_signal(signal.SIGCONT)
        mesh.stop()


def _ranks(status: dict) -> list[list[str]]:
    return [list(stage["ranks"]) for stage in status["stages"]]


def _standbys(status: dict) -> list[str]:
    planned = {node for ranks in _ranks(status) for node in ranks}
    return [n["node_id"] for n in status["nodes"] if n["node_id"] not in planned]


def _check_healed(mesh: MeshProcesses, victim: str, standbys: list[str]) -> None:
    after = mesh.status()
    ranks = _ranks(after)
    assert after["ready"] and len(ranks) == 2 and all(len(r) == 2 for r in ranks), after
    assert victim not in sum(ranks, []) and set(standbys) <= set(sum(ranks, [])), after


def test_a_rank_killed_mid_stream_is_replaced_by_the_standby_and_no_request_is_lost(
    groups: MeshProcesses,
) -> None:
    client = groups.client(timeout=300)
    status = groups.status()
    assert [len(r) for r in _ranks(status)] == [2, 2] and len(_standbys(status)) == 1, status
    before = [stream_request(client, r) for r in REQUESTS]
    victim = _ranks(status)[0][1]  # stage 0's follower: its leader's gate finds the link closed
    fail_mid_streams(groups, lambda: live_process(groups, victim).kill(), before)
    _check_healed(groups, victim, _standbys(status))
    assert stream_request(client, REQUESTS[0]) == before[0]


def test_a_stopped_rank_is_lost_at_its_groups_gate_timeout_and_no_request_is_lost(
    groups: MeshProcesses,
) -> None:
    """The node killed above joins again as the standby. Stage 1's leader stops: its follower
    waits at a gate for 3 s, reports it, and the coordinator takes the leader for lost."""
    client = groups.client(timeout=300)
    down = next(
        f"node{i}"
        for i in range(NODES)
        if f"node{i}" not in [n["node_id"] for n in groups.status()["nodes"]]
    )
    groups.join(down)
    wait_until(
        lambda: (
            any(n["node_id"] == down and n["checked"] for n in groups.status()["nodes"])
            and groups.status()["ready"]
        ),
        "the node to join again and the mesh to serve",
    )
    status = groups.status()
    before = [stream_request(client, r) for r in REQUESTS]
    victim = _ranks(status)[1][0]
    stopped = live_process(groups, victim)
    try:
        fail_mid_streams(groups, lambda: stopped.send_signal(signal.SIGSTOP), before)
        _check_healed(groups, victim, _standbys(status))
        lost = [
            line
            for line in groups.output
            if f"node {victim} left: its lockstep group lost it" in line
        ]
        assert lost and "sent nothing" in lost[0] and "within 3.0 s" in lost[0], lost
        assert not any(
            f"node {victim} sent nothing for" in line for line in groups.output
        )  # not by heartbeats
    finally:
        stopped.send_signal(signal.SIGCONT)
