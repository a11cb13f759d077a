"""No request lost: a node killed (SIGKILL) or stopped (SIGSTOP) mid-answer; the mesh plans
again over the others and every stream goes on from where it was, its text what a run without
the failure gives.

Three nodes whose memory caps let any two, and no one, hold the model. Four clients stream at
once (three greedy, one seeded at temperature 0.8); once each has its first tokens, a node of
the route fails. Each stream pauses, then continues: no token repeated or lost, the whole text
equal to the same request's answer before the failure.
"""

from __future__ import annotations

import signal
import threading
import time
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

CONTEXT = 1024


@pytest.fixture(scope="module")
def mesh3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    mesh = MeshProcesses(
        tmp_path_factory.mktemp("heal"),
        nodes=3,
        node_memory_gb=memory_cap_gb(None, 2, CONTEXT),
        serve_args=("--context", str(CONTEXT)),
    )
    try:
        mesh.start()
        mesh.wait_ready()
        yield mesh
    finally:
        mesh.stop()


def test_a_route_node_killed_mid_stream_loses_no_request(mesh3: MeshProcesses) -> None:
    client = mesh3.client(timeout=300)
    before = [stream_request(client, r) for r in REQUESTS]  # the answers without a failure
    route = [s["node_id"] for s in mesh3.status()["stages"]]
    victim = route[-1]  # the last stage: it samples every token
    fail_mid_streams(mesh3, lambda: live_process(mesh3, victim).kill(), before)
    after = mesh3.status()
    assert after["ready"] and victim not in [s["node_id"] for s in after["stages"]], after
    assert stream_request(client, REQUESTS[0]) == before[0]  # and the healed mesh serves on


def test_a_stopped_node_is_lost_within_the_heartbeat_timeout_and_a_standby_takes_its_place(
    mesh3: MeshProcesses,
) -> None:
    """The node killed above comes back (planned in, if the plan with it is fast enough more,
    else a standby). A node of the route stops (SIGSTOP: its sockets stay open); missed
    heartbeats take it for lost within 3 s and the route is planned again over the two others,
    a standby included; no stream loses a token."""
    client = mesh3.client(timeout=300)
    down = next(
        f"node{i}"
        for i in range(3)
        if f"node{i}" not in [n["node_id"] for n in mesh3.status()["nodes"]]
    )
    mesh3.join(down)
    wait_until(
        lambda: (
            any(n["node_id"] == down and n["checked"] for n in mesh3.status()["nodes"])
            and mesh3.status()["ready"]
        ),
        "the node to join again and the mesh to serve",
    )
    before = [stream_request(client, r) for r in REQUESTS]
    status = mesh3.status()
    route = [s["node_id"] for s in status["stages"]]
    standbys = [n["node_id"] for n in status["nodes"] if n["node_id"] not in route]
    victim = route[0]  # stage 0: it schedules every request
    stopped = live_process(mesh3, victim)
    try:
        began = time.monotonic()
        fail_mid_streams(mesh3, lambda: stopped.send_signal(signal.SIGSTOP), before)
        assert time.monotonic() - began < 60
        after = mesh3.status()
        assert after["ready"] and victim not in [n["node_id"] for n in after["nodes"]], after
        assert all(standby in [s["node_id"] for s in after["stages"]] for standby in standbys), (
            after
        )
        lost_lines = [line for line in mesh3.output if f"node {victim} sent nothing for" in line]
        assert (
            lost_lines and float(lost_lines[0].split("sent nothing for ")[1].split(" s")[0]) <= 4.0
        ), lost_lines
        _events_tell_it(mesh3, victim)
    finally:
        stopped.send_signal(signal.SIGCONT)


def _events_tell_it(mesh: MeshProcesses, victim: str) -> None:
    """The console's feed and /metrics read the coordinator's events: the loss, the re-plan, the
    replays, the new route and the replays resumed on it, in the order they were applied."""
    feed = mesh.status()["events"]
    lost = next(
        i
        for i, e in enumerate(feed)
        if e["kind"] == "node_lost" and e["message"].startswith(f"node {victim} left")
    )
    after = [e["kind"] for e in feed[lost:]]
    settled = [kind for kind in after if kind != "request_resumed"]
    assert (
        after[1] == "replanning"
        and settled[-1] == "route_published"
        and "request_replayed" in after
        and "request_resumed" in after
    ), feed
    # a replay resumes on the new route: after it is published
    published = after.index("route_published")
    assert all(i > published for i, kind in enumerate(after) if kind == "request_resumed"), feed
    assert feed[lost]["level"] == "warning" and [e["seq"] for e in feed] == sorted(
        e["seq"] for e in feed
    )
    metrics = mesh.http().get(f"{mesh.base_url}/metrics", timeout=10).text
    counted = {
        kind: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("seamline_mesh_events_total{")
        for kind in [line.split('"')[1]]
    }
    assert (
        counted["node_lost"] >= 1
        and counted["route_published"] >= 2
        and counted["request_replayed"] >= 1
    ), counted


def test_requests_wait_when_the_survivors_cannot_hold_the_model_and_a_joining_node_saves_them(
    mesh3: MeshProcesses,
) -> None:
    """Every node but one is killed mid-stream: the one left cannot hold the model, so the
    requests wait (the deadline is 120 s); a node that joins 3 s later lets the mesh plan again,
    and every stream ends as it would have."""
    client = mesh3.client(timeout=300)
    wait_until(
        lambda: (
            [n["checked"] for n in mesh3.status()["nodes"]] == [True] * 3
            and mesh3.status()["ready"]
        ),
        "all three nodes to be members and the mesh to serve",
    )
    before = [stream_request(client, r) for r in REQUESTS]
    keeper = mesh3.status()["stages"][0]["node_id"]
    others = [f"node{i}" for i in range(3) if f"node{i}" != keeper]

    def kill_all_but_one() -> None:
        for node_id in others:
            live_process(mesh3, node_id).kill()
        threading.Timer(3.0, mesh3.join, args=(others[0],)).start()

    began = time.monotonic()
    fail_mid_streams(mesh3, kill_all_but_one, before)
    assert time.monotonic() - began > 3.0
    after = mesh3.status()
    assert sorted(s["node_id"] for s in after["stages"]) == sorted([keeper, others[0]]), after
