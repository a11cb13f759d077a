"""No request lost: a node killed mid-answer; the mesh plans again over the survivors and every
stream goes on from where it was, its text what a run without the failure gives.

Three nodes whose memory caps let any two hold the model. Four clients stream at once (three
greedy, one seeded at temperature 0.8); once each has its first tokens, a node of the route is
killed with SIGKILL. Each stream pauses, then continues: no token repeated or lost, the whole
text equal to the same request's answer before the failure.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
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
    mesh3.node_procs[int(victim.removeprefix("node"))].kill()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert [answers[i] for i in range(len(REQUESTS))] == before
    after = mesh3.status()
    assert after["ready"] and victim not in [s["node_id"] for s in after["stages"]], after
    assert _stream(client, REQUESTS[0]) == before[0]  # and the healed mesh serves on
