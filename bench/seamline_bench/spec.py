"""`seamline bench spec`: speculative windows against none, side by side, through the API.

Each configuration runs two servers at the default precision, one with ``--speculative auto``
(the default) and one with ``--speculative off``, asked in turn (``--repeats`` times): one node
on 2 threads (``one_node``), one node on one core (``one_core``), and two stages pinned to one
core each in two network namespaces, on an emulated 1 GbE link (``mesh_lan``, 0.25 ms one
way) and with 10 ms one way (``mesh_wan``). Three workloads (``spec_prompts``), one client
streaming each: ``edit`` and ``quote`` greedy, ``open`` sampled (temperature 0.8, seed 1); and
on ``one_node`` 16 clients at once. For every row: the decode rates (tokens after the first
over the time from the first to the last) and their ratio, the acceptance and tokens per window
(from the server's /metrics), whether the answers are the same text, where they differ
whether the first differing token was a near tie (the top two log-probabilities of the run
without speculation within ``NEAR_TIE``), and how many answers of the server without
speculation differ from its own first run (``off_runs_differ``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from seamline_bench.servers import NodeSpec, Server, start_mesh, start_single
from seamline_bench.spec_prompts import WORKLOADS
from seamline_bench.split import NS_PREFIX, lan_down, lan_up
from seamline_bench.throughput import seamline_env

MAX_TOKENS = 256
CLIENTS_MANY = 16
NEAR_TIE = (
    1e-3  # log-probability gap of the top two under which a differing token counts as a near tie
)
SAMPLED = {"open": {"temperature": 0.8, "seed": 1}}  # the others greedy
WAN_DELAY_MS = 10.0
Starter = Callable[[str, dict[str, str], Path], Server]


def bench_spec(repeats: int = 3, tokens: int = MAX_TOKENS) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="seamline-spec-"))
    env = seamline_env()
    configurations: dict[str, Any] = {}
    singles: dict[str, Starter] = {
        "one_node": lambda mode, e, lg: start_single(
            f"one_node-{mode}", 2, e, lg, precision=None, speculative=mode
        ),
        "one_core": lambda mode, e, lg: start_single(
            f"one_core-{mode}", 1, e, lg, precision=None, speculative=mode
        ),
    }
    for name, start in singles.items():
        configurations[name] = _configuration(
            name, start, env, logs, repeats, tokens, many=name == "one_node"
        )
    for name, delay in (("mesh_lan", None), ("mesh_wan", WAN_DELAY_MS)):
        with _namespaces(delay) as why:
            configurations[name] = why or _configuration(
                name, _mesh_starter(name), env, logs, repeats, tokens
            )
    return _result(configurations, repeats, tokens, logs)


def _mesh_starter(name: str) -> Starter:
    """Two stages on one core each, one per namespace; the coordinator beside the first."""
    from seamline.server.demo import memory_cap_gb

    first, second = NodeSpec("0", 1, f"{NS_PREFIX}1"), NodeSpec("1", 1, f"{NS_PREFIX}2")
    cap = memory_cap_gb(None, 2, 2048, dtype_bytes=2)
    return lambda mode, env, logs: start_mesh(
        f"{name}-{mode}",
        [first, second],
        first,
        "10.77.0.1",
        env,
        logs,
        cap,
        precision=None,
        speculative=mode,
    )


@contextmanager
def _namespaces(delay_ms: float | None) -> Iterator[str]:
    """The two namespaces up (``delay_ms`` one way; None: the emulated LAN's); why not, or ""."""
    why = lan_up() if delay_ms is None else lan_up(delay_ms)
    try:
        yield f"not run: {why}" if why else ""
    finally:
        lan_down()


def _configuration(
    name: str,
    start: Starter,
    env: dict[str, str],
    logs: Path,
    repeats: int,
    tokens: int,
    many: bool = False,
) -> dict[str, Any]:
    servers = {mode: start(mode, env, logs) for mode in ("auto", "off")}
    try:
        for server in servers.values():
            server.wait_healthy()
            _wave(server, [("warm", "Say hello.")], 8, logs)
        rows = {
            workload: _compare(servers, [(workload, text)], repeats, tokens, logs)
            for workload, text in WORKLOADS.items()
        }
        if many:
            asks = [list(WORKLOADS.items())[i % len(WORKLOADS)] for i in range(CLIENTS_MANY)]
            rows[f"clients_{CLIENTS_MANY}"] = _compare(servers, asks, repeats, tokens // 2, logs)
        return rows
    finally:
        for server in servers.values():
            server.close()


def _compare(
    servers: dict[str, Server], asks: list[tuple[str, str]], repeats: int, tokens: int, logs: Path
) -> dict[str, Any]:
    """Both servers, alternating, ``repeats`` times; the rates' medians and the answers compared."""
    rates: dict[str, list[float]] = {"auto": [], "off": []}
    answers: dict[str, list[dict[str, Any]]] = {}
    first_off: list[str] = []
    before = after = _counters(_wave(servers["auto"], [("warm", "Say hello.")], 1, logs)["metrics"])
    for _ in range(repeats):
        for mode in ("off", "auto"):
            wave = _wave(servers[mode], asks, tokens, logs)
            rates[mode].append(
                wave["tok_s"] if len(asks) > 1 else wave["streams"][0]["decode_tok_s"]
            )
            answers[mode] = wave["streams"]
            first_off = first_off or [s["text"] for s in wave["streams"]]
            if mode == "auto":
                after = _counters(wave["metrics"])
    windows, drafted, accepted = (after[k] - before[k] for k in ("windows", "drafted", "accepted"))
    flips, differing = _differences(servers["off"], asks, answers, tokens, logs)
    auto, off = statistics.median(rates["auto"]), statistics.median(rates["off"])
    return {
        "tok_s": {"auto": round(auto, 2), "off": round(off, 2)},
        "ratio": round(auto / off, 3),
        "runs_tok_s": {mode: [round(r, 2) for r in values] for mode, values in rates.items()},
        "acceptance": round(accepted / drafted, 3) if drafted else None,
        "tokens_per_window": round((accepted + windows) / windows, 2) if windows else None,
        "outputs_identical": differing == 0,
        "near_tie_flips": flips,
        "other_differences": differing - flips,
        "off_runs_differ": sum(a != s["text"] for a, s in zip(first_off, answers["off"])),
        "tokens_compared": sum(s["tokens"] for s in answers["off"]),
    }


def _wave(server: Server, asks: list[tuple[str, str]], tokens: int, logs: Path) -> dict[str, Any]:
    """One wave from a client process where the server's clients run (its namespace)."""
    path = logs / "asks.json"
    path.write_text(
        json.dumps([[name, text, SAMPLED.get(name, {"temperature": 0})] for name, text in asks])
    )
    command = [
        *server.client_prefix,
        sys.executable,
        "-m",
        "seamline_bench.spec_client",
        server.url,
        server.model,
        str(tokens),
        str(path),
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"the client against {server.name} failed: {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _counters(metrics: str) -> dict[str, float]:
    names = {
        "windows": "seamline_speculative_windows_total",
        "drafted": "seamline_speculative_draft_tokens_total",
        "accepted": "seamline_speculative_accepted_tokens_total",
    }
    values = {
        line.split()[0]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("seamline_spec")
    }
    return {key: values.get(name, 0.0) for key, name in names.items()}


def _differences(
    off: Server,
    asks: list[tuple[str, str]],
    answers: dict[str, list[dict[str, Any]]],
    tokens: int,
    logs: Path,
) -> tuple[int, int]:
    """(near-tie flips, answers that differ) between the two servers' last runs."""
    flips = differing = 0
    for (name, text), plain, drafted in zip(asks, answers["off"], answers["auto"]):
        if plain["text"] == drafted["text"]:
            continue
        differing += 1
        ask, other = logs / "ask.json", logs / "other.txt"
        ask.write_text(json.dumps([name, text, SAMPLED.get(name, {"temperature": 0})]))
        other.write_text(drafted["text"])
        command = [
            *off.client_prefix,
            sys.executable,
            "-m",
            "seamline_bench.spec_client",
            "near-tie",
            off.url,
            off.model,
            str(tokens),
            str(ask),
            str(other),
            str(NEAR_TIE),
        ]
        flips += json.loads(
            subprocess.run(command, capture_output=True, text=True, timeout=600, check=True).stdout
        )
    return flips, differing


def _result(
    configurations: dict[str, Any], repeats: int, tokens: int, logs: Path
) -> dict[str, Any]:
    rows = [row for c in configurations.values() if isinstance(c, dict) for row in c.values()]

    def ratio(config: str, workload: str) -> float | None:
        c = configurations.get(config)
        return c[workload]["ratio"] if isinstance(c, dict) else None

    lan, one_core = configurations.get("mesh_lan"), configurations["one_core"]
    return {
        "bench": "spec",
        "model": "embedded (SmolLM2-135M-Instruct Q4_1), default precision",
        "repeats": repeats,
        "max_tokens": tokens,
        "workloads": {
            name: {"prompt": text, "sampling": SAMPLED.get(name, {"temperature": 0})}
            for name, text in WORKLOADS.items()
        },
        "configurations": configurations,
        "edit_gain_1node": ratio("one_node", "edit"),
        "edit_mesh_vs_1node": round(
            lan["edit"]["tok_s"]["auto"] / one_core["edit"]["tok_s"]["auto"], 3
        )
        if isinstance(lan, dict)
        else None,
        "edit_gain_wan": ratio("mesh_wan", "edit"),
        "open_ratio_min": min(
            c["open"]["ratio"] for c in configurations.values() if isinstance(c, dict)
        ),
        "auto_vs_off_16": configurations["one_node"][f"clients_{CLIENTS_MANY}"]["ratio"],
        "outputs_identical": all(r["outputs_identical"] for r in rows),
        "tokens_compared": sum(r["tokens_compared"] for r in rows),
        "near_tie_flips": sum(r["near_tie_flips"] for r in rows),
        "logs": str(logs),
    }
