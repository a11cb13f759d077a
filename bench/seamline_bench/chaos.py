"""`seamline bench chaos`: a mesh serving steadily while its nodes die and come back.

Once at each precision of ``PRECISIONS``, a mesh of its own: the default a user gets with no
flag, and ``--precision exact`` (float32), whose answers must not change. Three nodes (memory
caps under which any two, and no one, hold the model) serve 8
clients that stream the same 8 requests over and over (greedy and seeded sampling, alternately).
A calm phase gives each request's answer without failures and the steady rate. Then, for each
round, a random node of the route is killed (SIGKILL; every fourth round SIGSTOP, which only
missed heartbeats reveal) and started again 5 s later; the next round waits until it has
joined again. Every answer during the chaos is compared with the calm one.

The JSON has a block per precision (``precisions``: the coordinator's ``precision`` and these
fields): ``requests`` (answers completed or failed during the chaos), ``lost`` (failed),
``outputs_changed`` (differing from the calm answer, other than at a near-tie: those, where
the reference model's logits of the two tokens chosen are within 1e-3 where the answers first
differ, are counted apart as ``near_tie_flips``; ``bench.near_tie``), recovery per
affected stream (from the failure to that stream's next token: p50, p95), and the decode rates
without failures and during the chaos.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from seamline.server.demo import memory_cap_gb
from seamline_bench.near_tie import TieJudge
from seamline_bench.servers import NodeSpec, Server, start_mesh

CONTEXT = 2048
NODES = 3
RESTART_AFTER_S = 5.0
CALM_S = 30.0
# name in the JSON -> (`--precision`, None for no flag; bytes per KV value, for the memory caps)
PRECISIONS: dict[str, tuple[str | None, int]] = {"default": (None, 2), "exact": ("exact", 4)}
PROMPTS = [
    "Name three rivers in Europe and one fact about each.",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "List five uses of a paperclip.",
    "What is the capital of France and why is it famous?",
    "Tell me a short story about a fox.",
    "Describe a sunrise over the mountains.",
    "Give three tips for learning to cook.",
]


@dataclass
class ClientAnswer:
    client: int
    began: float
    ended: float = 0.0
    text: str = ""
    error: str = ""
    token_times: list[float] = field(default_factory=list)


def _request(client: int) -> dict[str, Any]:
    """Client i's request: greedy for even i, seeded at temperature 0.8 for odd."""
    sampling: dict[str, Any] = (
        {"temperature": 0} if client % 2 == 0 else {"temperature": 0.8, "seed": 100 + client}
    )
    return {"messages": [{"role": "user", "content": PROMPTS[client]}], **sampling}


class Clients:
    """``count`` threads streaming their request again and again until ``stop``."""

    def __init__(self, url: str, count: int, tokens: int) -> None:
        self.api = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        self.count, self.tokens = count, tokens
        self.answers: list[ClientAnswer] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(count)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=900)

    def _loop(self, client: int) -> None:
        while not self._stop.is_set():
            answer = ClientAnswer(client, time.monotonic())
            try:
                stream = self.api.chat.completions.create(
                    model="default", max_tokens=self.tokens, stream=True, **_request(client)
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        answer.text += chunk.choices[0].delta.content
                        answer.token_times.append(time.monotonic())
            except openai.APIError as exc:
                answer.error = _described(exc, len(answer.token_times))
            answer.ended = time.monotonic()
            with self._lock:
                self.answers.append(answer)

    def taken(self, since: float) -> list[ClientAnswer]:
        with self._lock:
            return [a for a in self.answers if a.began >= since]


def _described(exc: openai.APIError, tokens: int) -> str:
    """The error, with what lay under a connection error and how far the stream had come."""
    cause = (
        f" ({exc.__cause__!r})"
        if isinstance(exc, openai.APIConnectionError) and exc.__cause__
        else ""
    )
    return f"{exc}{cause}" + (f" after {tokens} tokens" if tokens else "")


def bench_chaos(rounds: int = 20, clients: int = 8, tokens: int = 48) -> dict[str, Any]:
    """A block per precision of ``PRECISIONS``, each from a mesh of its own."""
    return {
        "bench": "chaos",
        "precisions": {
            name: _chaos_at(flag, kv_bytes, rounds, clients, tokens)
            for name, (flag, kv_bytes) in PRECISIONS.items()
        },
    }


def _chaos_at(
    precision: str | None, kv_bytes: int, rounds: int, clients: int, tokens: int
) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="seamline-chaos-"))
    env = dict(os.environ)
    cap = memory_cap_gb(None, 2, CONTEXT, dtype_bytes=kv_bytes)
    server = start_mesh(
        "chaos",
        [NodeSpec("0,1", 1) for _ in range(NODES)],
        NodeSpec("0,1", 1),
        "127.0.0.1",
        env,
        logs,
        cap,
        precision=precision,
    )
    try:
        server.wait_healthy()
        described = mesh_status(server).get("precision")
        load = Clients(server.url, clients, tokens)
        load.start()
        time.sleep(3.0)  # warm-up, not counted
        calm_from = time.monotonic()
        time.sleep(CALM_S)
        calm_to = time.monotonic()
        failures = [_round(server, env, logs, r) for r in range(rounds)]
        chaos_to = time.monotonic()
        load.stop()
        result = _result(load, calm_from, calm_to, chaos_to, failures, rounds, logs)
        return {"precision": described, **result}
    finally:
        server.close()


def _round(server: Server, env: dict[str, str], logs: Path, index: int) -> dict[str, Any]:
    """Fail a random node of the route, start it again after RESTART_AFTER_S, wait until the
    mesh is whole and ready again; when it failed and how."""
    time.sleep(random.uniform(2.0, 4.0))
    status = mesh_status(server)
    victim = random.choice([s["node_id"] for s in status["stages"]])
    number = int(victim.removeprefix("chaos"))
    proc = server.procs[1 + number]
    how = "SIGSTOP" if index % 4 == 3 else "SIGKILL"
    failed_at = time.monotonic()
    proc.send_signal(signal.SIGSTOP if how == "SIGSTOP" else signal.SIGKILL)
    time.sleep(RESTART_AFTER_S)
    proc.kill()  # a stopped node is killed now: the mesh has taken it for lost
    proc.wait()
    node_env = {**env, "SEAMLINE_CACHE": str(logs / f"cache-chaos{number}")}
    server.procs[1 + number] = subprocess.Popen(
        list(proc.args),
        env=node_env,  # type: ignore[arg-type]
        stdout=(logs / f"chaos-node{number}.log").open("a"),
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not _whole(mesh_status(server)):
        time.sleep(0.5)
    return {"node": victim, "how": how, "at": failed_at}


def _whole(status: dict[str, Any]) -> bool:
    """Whether the mesh serves with all NODES joined: each measured and checked, not only
    admitted (a node being measured is listed, but cannot be planned yet)."""
    nodes = status.get("nodes", [])
    return bool(status.get("ready")) and len(nodes) == NODES and all(n["checked"] for n in nodes)


def mesh_status(server: Server) -> dict[str, Any]:
    try:
        return dict(httpx.get(server.url.removesuffix("/v1") + "/api/status", timeout=10).json())
    except (httpx.HTTPError, ValueError):
        return {}


def _recoveries(answers: list[ClientAnswer], failures: list[dict[str, Any]]) -> list[float]:
    """Per stream in flight at a failure: seconds from the failure to its next token."""
    return [gap for failure in failures for gap in _gaps(answers, failure["at"])]


def _gaps(answers: list[ClientAnswer], at: float) -> list[float]:
    """Per stream in flight at ``at``: seconds from ``at`` to its next token."""
    return [
        next(t for t in answer.token_times if t > at) - at
        for answer in answers
        if answer.began < at < answer.ended and answer.token_times and answer.token_times[-1] > at
    ]


def _slowest_per_failure(
    answers: list[ClientAnswer], failures: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each failure, in order: its node, how, and its slowest stream's recovery (s)."""
    return [
        {
            "node": f["node"],
            "how": f["how"],
            "slowest_recovery_s": _pct(_gaps(answers, f["at"]), 1.0),
        }
        for f in failures
    ]


def stream_rate(answers: list[ClientAnswer], since: float, until: float) -> float:
    """Tokens streamed per second between ``since`` and ``until`` (of answers that ended)."""
    tokens = sum(1 for a in answers for t in a.token_times if since <= t < until)
    return tokens / (until - since)


def _near_ties(differ: list[ClientAnswer], reference: dict[int, str]) -> list[ClientAnswer]:
    """The answers that first differ from their calm one at a near-tie."""
    judge = TieJudge(CONTEXT)
    return [
        a
        for a in differ
        if judge.near_tie(_request(a.client)["messages"], reference[a.client], a.text)
    ]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def _result(
    load: Clients,
    calm_from: float,
    calm_to: float,
    chaos_to: float,
    failures: list[dict[str, Any]],
    rounds: int,
    logs: Path,
) -> dict[str, Any]:
    calm = [a for a in load.answers if calm_from <= a.began and a.ended <= calm_to and not a.error]
    reference = {a.client: a.text for a in calm}
    chaos = [
        a for a in load.answers if a.began >= calm_to or (a.ended > calm_to and a.began < calm_to)
    ]
    lost = [a for a in chaos if a.error]
    differ = [
        a for a in chaos if not a.error and a.client in reference and a.text != reference[a.client]
    ]
    ties = _near_ties(differ, reference) if differ else []
    changed = [a for a in differ if a not in ties]
    unstable = [c for c in range(load.count) if len({a.text for a in calm if a.client == c}) > 1]
    recoveries = _recoveries(load.answers, failures)
    return {
        "bench": "chaos",
        "model": "SmolLM2-135M-Instruct.Q4_1, 3 nodes, any 2 hold it",
        "rounds": rounds,
        "clients": load.count,
        "tokens_per_request": load.tokens,
        "requests": len(chaos),
        "lost": len(lost),
        "outputs_changed": len(changed),
        "near_tie_flips": len(ties),
        "recovery_s_p50": _pct(recoveries, 0.5),
        "recovery_s_p95": _pct(recoveries, 0.95),
        "recovery_s_max": _pct(recoveries, 1.0),
        "streams_recovered": len(recoveries),
        "tok_s_without_failures": round(stream_rate(load.answers, calm_from, calm_to), 2),
        "tok_s_during_chaos": round(stream_rate(load.answers, calm_to, chaos_to), 2),
        "calm_requests": len(calm),
        "calm_answers_unstable": unstable,  # a request whose calm answers differ among themselves
        "failures": _slowest_per_failure(load.answers, failures),
        "lost_errors": sorted({a.error[:200] for a in lost})[:5],
        "changed_examples": [
            {"client": a.client, "got": a.text[:120], "calm": reference[a.client][:120]}
            for a in changed[:3]
        ],
        "logs": str(logs),
        "median_request_s": round(statistics.median(a.ended - a.began for a in chaos), 2)
        if chaos
        else None,
    }
