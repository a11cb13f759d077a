"""Streams that outlive a node: start, fail mid-stream, wait."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import openai

from tests.support.mesh_harness import MeshProcesses

TOKENS = 40

REQUESTS: list[dict[str, Any]] = [
    {"content": "Name three rivers in Europe and one fact about each.", "temperature": 0},
    {"content": "Write a haiku about the sea.", "temperature": 0},
    {"content": "What is the capital of France?", "temperature": 0},
    {"content": "Tell me a short story about a fox.", "temperature": 0.8, "seed": 7},
]


def stream_request(
    client: openai.OpenAI, request: dict[str, Any], started: threading.Event | None = None
) -> tuple[str, str]:
    """The streamed text and finish reason; ``started`` is set once three chunks have come."""
    sampling = {k: v for k, v in request.items() if k != "content"}
    stream = client.chat.completions.create(
        model="default",
        max_tokens=TOKENS,
        stream=True,
        messages=[{"role": "user", "content": request["content"]}],
        **sampling,
    )
    text, reason, chunks = "", "", 0
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        reason = choice.finish_reason or reason
        chunks += 1
        if started is not None and chunks == 3:
            started.set()
    return text, reason


def live_process(mesh: MeshProcesses, node_id: str) -> subprocess.Popen[str]:
    """The live process of ``node_id`` (a node that joined again has a newer one)."""
    index = max(i for i, proc in enumerate(mesh.node_procs) if node_id_of(proc) == node_id)
    return mesh.node_procs[index]


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def fail_mid_streams(
    mesh: MeshProcesses, fail: Callable[[], None], before: list[tuple[str, str]]
) -> None:
    """Stream every request at once; ``fail()`` once each has its first tokens; every answer
    must equal ``before``."""
    client = mesh.client(timeout=300)
    started = [threading.Event() for _ in REQUESTS]
    answers: dict[int, tuple[str, str]] = {}
    errors: dict[int, BaseException] = {}

    def client_thread(i: int) -> None:
        try:
            answers[i] = stream_request(client, REQUESTS[i], started[i])
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


def node_id_of(proc: subprocess.Popen[str]) -> str:
    args = list(proc.args)  # type: ignore[arg-type]
    return str(args[args.index("--node-id") + 1])
