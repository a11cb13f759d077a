"""Recovery without the dead: a node of three killed mid-stream and kept dead, the two survivors
serve again within ``RECOVERY_BOUND_S``. Their route is published once they have loaded their
new ranges and passed the start-up check: it waits neither for the lost node to come back nor
for a stage's speed probe (``mesh.node.idle_probe``; two survivors probing in turn held each
recovery some 15 s, about as long as a killed node took to restart and join again).

Three nodes whose memory caps let any two, and no one, hold the model; one client streams; once
it has its first tokens the last stage is killed (SIGKILL) and never started again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import openai

from seamline.server.demo import memory_cap_gb
from tests.support.heal import REQUESTS, TOKENS, live_process
from tests.support.mesh_harness import MeshProcesses

CONTEXT = 1024
# from the kill to the stream's next token: a closed link is seen at once, the survivors load
# their new ranges from their caches and each other's, and the stream's tokens so far replay
# (on this machine's two cores shared with other tests it took 3-7 s)
RECOVERY_BOUND_S = 10.0


def _stream(client: openai.OpenAI, fail: Callable[[], None] = lambda: None) -> list[float]:
    """Request 0 streamed, ``fail()`` called once its third chunk has come: when each chunk came
    (the text is held to the answer without a failure by ``test_mesh_heal``)."""
    request = REQUESTS[0]
    stream = client.chat.completions.create(
        model="default",
        max_tokens=TOKENS,
        stream=True,
        temperature=request["temperature"],
        messages=[{"role": "user", "content": request["content"]}],
    )
    times: list[float] = []
    for _ in stream:
        times.append(time.monotonic())
        if len(times) == 3:
            fail()
    return times


def test_the_survivors_serve_within_seconds_while_the_lost_node_stays_dead(
    tmp_path: Path,
) -> None:
    mesh = MeshProcesses(
        tmp_path,
        nodes=3,
        node_memory_gb=memory_cap_gb(None, 2, CONTEXT),
        serve_args=("--context", str(CONTEXT)),
    )
    try:
        mesh.start()
        mesh.wait_ready()
        client = mesh.client(timeout=120)
        _stream(client)  # every stage has served once: the kill finds a warm mesh
        victim = mesh.status()["stages"][-1]["node_id"]  # the last stage: it draws every token
        process = live_process(mesh, victim)
        killed: list[float] = []

        def kill() -> None:
            process.kill()
            killed.append(time.monotonic())

        after = [at for at in _stream(client, kill) if at > killed[0]]
        assert after, "no token came after the kill"
        recovery = after[0] - killed[0]
        assert recovery < RECOVERY_BOUND_S, (
            f"the survivors served again {recovery:.1f} s after the kill",
            "".join(mesh.output[-12:]),
        )
        status = mesh.status()
        assert process.poll() is not None and victim not in [n["node_id"] for n in status["nodes"]]
        assert status["ready"] and victim not in [s["node_id"] for s in status["stages"]], status
    finally:
        mesh.stop()
