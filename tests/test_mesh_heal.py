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
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from seamline.server.demo import memory_cap_gb
from tests.mesh_harness import MeshProcesses

CONTEXT = 1024
TOKENS = 40
REQUESTS: list[dict[str, Any]] = [
    {"content": "Name three rivers in Europe and one fact about each.", "temperature": 0},
    {"content": "Write a haiku about the sea.", "temperature": 0},
    {"content": "What is the capital of France?", "temperature": 0},
    {"content": "Tell me a short story about a fox.", "temperature": 0.8, "seed": 7},
]


def _stream(client: openai.OpenAI, request: dict[str, Any], started: threading.Event | None = None) -> tuple[str, str]:
    """The streamed text and finish reason; ``started`` is set once three chunks have come."""
    sampling = {k: v for k, v in request.items() if k != "content"}
    stream = client.chat.completions.create(model="default", max_tokens=TOKENS, stream=True,
                                            messages=[{"role": "user", "content": request["content"]}],
                                            **sampling)  # fmt: skip
    text, reason, chunks = "", "", 0
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        reason = choice.finish_reason or reason
        chunks += 1
        if started is not None and chunks == 3:
            started.set()
    return text, reason


@pytest.fixture(scope="module")
def mesh3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    mesh = MeshProcesses(tmp_path_factory.mktemp("heal"), nodes=3, node_memory_gb=memory_cap_gb(None, 2, CONTEXT),
                         serve_args=("--context", str(CONTEXT)))  # fmt: skip
    try:
        mesh.start()
        mesh.wait_ready()
        yield mesh
    finally:
        mesh.stop()


def test_a_route_node_killed_mid_stream_loses_no_request(mesh3: MeshProcesses) -> None:
    client = mesh3.client(timeout=300)
    before = [_stream(client, r) for r in REQUESTS]  # the answers without a failure
    route = [s["node_id"] for s in mesh3.status()["stages"]]
    victim = route[-1]  # the last stage: it samples every token
    _fail_mid_streams(mesh3, lambda: _process(mesh3, victim).kill(), before)
    after = mesh3.status()
    assert after["ready"] and victim not in [s["node_id"] for s in after["stages"]], after
    assert _stream(client, REQUESTS[0]) == before[0]  # and the healed mesh serves on


def test_a_stopped_node_is_lost_within_the_heartbeat_timeout_and_a_standby_takes_its_place(
    mesh3: MeshProcesses,
) -> None:
    """The node killed above comes back (planned in, if the plan with it is fast enough more,
    else a standby). A node of the route stops (SIGSTOP: its sockets stay open); missed
    heartbeats take it for lost within 3 s and the route is planned again over the two others,
    a standby included; no stream loses a token."""
    client = mesh3.client(timeout=300)
    down = next(f"node{i}" for i in range(3) if f"node{i}" not in [n["node_id"] for n in mesh3.status()["nodes"]])
    mesh3.join(down)
    _until(lambda: any(n["node_id"] == down and n["checked"] for n in mesh3.status()["nodes"])
           and mesh3.status()["ready"], "the node to join again and the mesh to serve")  # fmt: skip
    before = [_stream(client, r) for r in REQUESTS]
    status = mesh3.status()
    route = [s["node_id"] for s in status["stages"]]
    standbys = [n["node_id"] for n in status["nodes"] if n["node_id"] not in route]
    victim = route[0]  # stage 0: it schedules every request
    stopped = _process(mesh3, victim)
    try:
        began = time.monotonic()
        _fail_mid_streams(mesh3, lambda: stopped.send_signal(signal.SIGSTOP), before)
        assert time.monotonic() - began < 60
        after = mesh3.status()
        assert after["ready"] and victim not in [n["node_id"] for n in after["nodes"]], after
        assert all(standby in [s["node_id"] for s in after["stages"]] for standby in standbys), after
        lost_lines = [line for line in mesh3.output if f"node {victim} sent nothing for" in line]
        assert lost_lines and float(lost_lines[0].split("sent nothing for ")[1].split(" s")[0]) <= 4.0, lost_lines
    finally:
        stopped.send_signal(signal.SIGCONT)


def _process(mesh: MeshProcesses, node_id: str) -> subprocess.Popen[str]:
    """The live process of ``node_id`` (a node that joined again has a newer one)."""
    index = max(i for i, proc in enumerate(mesh.node_procs) if _node_id(proc) == node_id)
    return mesh.node_procs[index]


def _node_id(proc: subprocess.Popen[str]) -> str:
    args = list(proc.args)  # type: ignore[arg-type]
    return str(args[args.index("--node-id") + 1])


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def _fail_mid_streams(mesh: MeshProcesses, fail: Callable[[], None], before: list[tuple[str, str]]) -> None:
    """Stream every request at once; ``fail()`` once each has its first tokens; every answer
    must equal ``before``."""
    client = mesh.client(timeout=300)
    started = [threading.Event() for _ in REQUESTS]
    answers: dict[int, tuple[str, str]] = {}
    errors: dict[int, BaseException] = {}

    def client_thread(i: int) -> None:
        try:
            answers[i] = _stream(client, REQUESTS[i], started[i])
        except BaseException as exc:  # reported below with the request it belongs to
            errors[i] = exc
            started[i].set()

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(len(REQUESTS))]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(timeout=120)
    fail()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert [answers[i] for i in range(len(REQUESTS))] == before


def test_requests_wait_when_the_survivors_cannot_hold_the_model_and_a_joining_node_saves_them(
    mesh3: MeshProcesses,
) -> None:
    """Every node but one is killed mid-stream: the one left cannot hold the model, so the
    requests wait (the deadline is 120 s); a node that joins 3 s later lets the mesh plan again,
    and every stream ends as it would have."""
    client = mesh3.client(timeout=300)
    _until(lambda: [n["checked"] for n in mesh3.status()["nodes"]] == [True] * 3 and mesh3.status()["ready"],
           "all three nodes to be members and the mesh to serve")  # fmt: skip
    before = [_stream(client, r) for r in REQUESTS]
    keeper = mesh3.status()["stages"][0]["node_id"]
    others = [f"node{i}" for i in range(3) if f"node{i}" != keeper]

    def kill_all_but_one() -> None:
        for node_id in others:
            _process(mesh3, node_id).kill()
        threading.Timer(3.0, mesh3.join, args=(others[0],)).start()

    began = time.monotonic()
    _fail_mid_streams(mesh3, kill_all_but_one, before)
    assert time.monotonic() - began > 3.0
    after = mesh3.status()
    assert sorted(s["node_id"] for s in after["stages"]) == sorted([keeper, others[0]]), after
