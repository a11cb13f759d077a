"""`seamline bench growth`: does a node that joins a serving mesh raise its throughput?

Two nodes share core 0 (one thread each; memory caps under which any two, and no one, hold
the model, ``--precision exact``: float32, for answers are compared) and serve 8 clients that
stream the same 8 requests over and over (greedy and seeded, alternately, as in `bench chaos`). After a steady phase, a third node
joins pinned to core 1: it brings a core, as a new machine would. The coordinator plans it in
when it predicts the plan with it at least 10% faster (live growth); the requests in flight
replay on the new route. After the switch, a second steady phase.

Fields: ``tok_s_before`` and ``tok_s_after`` (tokens streamed per second in each phase) and
``gain`` (their ratio); ``predicted_gain`` (what the coordinator predicted when it switched);
``switch_s`` (from the join to the mesh serving on the new route); ``requests``, ``lost``
(answers that failed) and ``outputs_changed`` (answers unlike that client's first answer).
The coordinator, the clients and the new node share core 1.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from seamline.server.demo import memory_cap_gb
from seamline_bench.chaos import CONTEXT, Clients, mesh_status, stream_rate
from seamline_bench.servers import NodeSpec, Server, join_node, start_mesh

PHASE_S = 45.0
WARM_S = 5.0
SWITCH_TIMEOUT_S = 300.0


def bench_growth(clients: int = 8, tokens: int = 48, phase_s: float = PHASE_S) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="seamline-growth-"))
    env = dict(os.environ)
    cap = memory_cap_gb(None, 2, CONTEXT)
    server = start_mesh(
        "growth",
        [NodeSpec("0", 1), NodeSpec("0", 1)],
        NodeSpec("1", 1),
        "127.0.0.1",
        env,
        logs,
        cap,
        precision="exact",
    )  # answers are compared
    try:
        server.wait_healthy()
        route_before = _route(server)
        load = Clients(server.url, clients, tokens)
        load.start()
        before_from, before_to = _phase(phase_s)
        joined_at = time.monotonic()
        join_node(server, 2, NodeSpec("1", 1), env, logs, cap)
        switched_at = _wait_planned_in(server, "growth2", joined_at)
        after_from, after_to = _phase(phase_s)
        load.stop()
        return _result(
            load,
            (before_from, before_to),
            (after_from, after_to),
            switched_at - joined_at,
            route_before,
            _route(server),
            logs,
        )
    finally:
        server.close()


def _phase(seconds: float) -> tuple[float, float]:
    """Let the load settle, then measure for ``seconds``: the window's bounds."""
    time.sleep(WARM_S)
    began = time.monotonic()
    time.sleep(seconds)
    return began, time.monotonic()


def _route(server: Server) -> list[str]:
    return [stage["node_id"] for stage in mesh_status(server).get("stages", [])]


def _wait_planned_in(server: Server, node_id: str, since: float) -> float:
    """When the mesh first served with ``node_id`` on its route."""
    while time.monotonic() - since < SWITCH_TIMEOUT_S:
        status = mesh_status(server)
        if status.get("ready") and node_id in [s["node_id"] for s in status.get("stages", [])]:
            return time.monotonic()
        time.sleep(0.25)
    raise TimeoutError(
        f"{node_id} was not planned in within {SWITCH_TIMEOUT_S:.0f} s: {mesh_status(server)}"
    )


def _predicted_gain(logs: Path) -> float | None:
    text = (logs / "growth.log").read_text(errors="replace")
    found = re.findall(r"planning growth2 in: predicted ([0-9.]+)x", text)
    return float(found[0]) if found else None


def _result(
    load: Clients,
    before: tuple[float, float],
    after: tuple[float, float],
    switch_s: float,
    route_before: list[str],
    route_after: list[str],
    logs: Path,
) -> dict[str, Any]:
    first = {}
    for answer in sorted(load.answers, key=lambda a: a.began):
        if not answer.error:
            first.setdefault(answer.client, answer.text)
    lost = [a for a in load.answers if a.error]
    changed = [a for a in load.answers if not a.error and a.text != first[a.client]]
    rate_before, rate_after = stream_rate(load.answers, *before), stream_rate(load.answers, *after)
    return {
        "bench": "growth",
        "model": "SmolLM2-135M-Instruct.Q4_1 (float32), any 2 nodes hold it",
        "layout": "2 nodes on core 0, then a third joins on core 1 (with the coordinator and the clients)",
        "clients": load.count,
        "tokens_per_request": load.tokens,
        "phase_s": round(before[1] - before[0], 1),
        "tok_s_before": round(rate_before, 2),
        "tok_s_after": round(rate_after, 2),
        "gain": round(rate_after / rate_before, 3) if rate_before else None,
        "predicted_gain": _predicted_gain(logs),
        "switch_s": round(switch_s, 2),
        "route_before": route_before,
        "route_after": route_after,
        "requests": len(load.answers),
        "lost": len(lost),
        "outputs_changed": len(changed),
        "lost_errors": sorted({a.error[:200] for a in lost})[:5],
        "logs": str(logs),
    }
