"""`seamline bench spec`: speculative windows against none, side by side, through the API.

One `seamline serve --single` at the default precision on 2 threads with ``--speculative
auto`` (the default) and one with ``--speculative off``, started together and asked in turn.
Three workloads (``spec_prompts``), one client streaming each: ``edit`` and ``quote`` greedy,
``open`` sampled (temperature 0.8, seed 1), so a seeded draw is compared too. Then 16 clients
at once, each with its own workload, greedy. For every row: the decode rate (tokens after the
first over the time from the first to the last), the acceptance and tokens per window (from
the server's /metrics, before and after), whether the answers are the same text, and where
they differ whether the first differing token was a near tie (the top two log-probabilities
of the run without speculation within ``NEAR_TIE``).

The configurations across a mesh (two stages on one core each, on an emulated 1 GbE link and
with 10 ms of delay) need a mesh that speculates; until then they are reported as not run.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from seamline.bench.servers import Server, start_single
from seamline.bench.spec_prompts import WORKLOADS
from seamline.bench.throughput import seamline_env

THREADS = 2
MAX_TOKENS = 256
CLIENTS_MANY = 16
NEAR_TIE = 1e-3  # log-probability gap of the top two under which a differing token counts as a near tie
SAMPLED = {"open": {"temperature": 0.8, "seed": 1}}  # the others greedy
MESH_NOT_RUN = "not run: a mesh does not speculate yet (speculation runs on one process so far)"


def bench_spec(repeats: int = 3, tokens: int = MAX_TOKENS) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="seamline-spec-"))
    env = seamline_env()
    servers = {mode: start_single(f"spec-{mode}", THREADS, env, logs, precision=None, extra=("--speculative", mode))
               for mode in ("auto", "off")}  # fmt: skip
    try:
        return _measure(servers, repeats, tokens, logs)
    finally:
        for server in servers.values():
            server.close()


def _measure(servers: dict[str, Server], repeats: int, tokens: int, logs: Path) -> dict[str, Any]:
    for server in servers.values():
        server.wait_healthy()
        asyncio.run(_streams(server, [("warm", "Say hello.")], 8))
    rows: dict[str, dict[str, Any]] = {}
    for name, text in WORKLOADS.items():
        rows[name] = _compare(servers, [(name, text)], repeats, tokens)
    many = [(name, text) for _, (name, text) in zip(range(CLIENTS_MANY), _cycle(WORKLOADS))]
    rows["clients_16"] = _compare(servers, many, repeats, tokens // 2)
    return _result(rows, repeats, tokens, logs)


def _cycle(workloads: dict[str, str]) -> Any:
    while True:
        yield from workloads.items()


def _compare(servers: dict[str, Server], asks: list[tuple[str, str]], repeats: int, tokens: int) -> dict[str, Any]:
    """Both servers, alternating, ``repeats`` times; the rates' medians and the answers compared."""
    rates: dict[str, list[float]] = {"auto": [], "off": []}
    answers: dict[str, list[dict[str, Any]]] = {}
    first_off: list[str] = []
    before = _speculation_counters(servers["auto"])
    for _ in range(repeats):
        for mode in ("off", "auto"):
            wave = asyncio.run(_streams(servers[mode], asks, tokens))
            rates[mode].append(wave["tok_s"] if len(asks) > 1 else wave["streams"][0]["decode_tok_s"])
            answers[mode] = wave["streams"]
            first_off = first_off or [s["text"] for s in wave["streams"]]
    after = _speculation_counters(servers["auto"])
    windows, drafted, accepted = (after[k] - before[k] for k in ("windows", "drafted", "accepted"))
    flips, differing = _differences(servers["off"], asks, answers, tokens)
    return {
        "tok_s": {"auto": round(statistics.median(rates["auto"]), 2), "off": round(statistics.median(rates["off"]), 2)},
        "ratio": round(statistics.median(rates["auto"]) / statistics.median(rates["off"]), 3),
        "runs_tok_s": {mode: [round(r, 2) for r in values] for mode, values in rates.items()},
        "acceptance": round(accepted / drafted, 3) if drafted else None,
        "tokens_per_window": round((accepted + windows) / windows, 2) if windows else None,
        "outputs_identical": differing == 0,
        "near_tie_flips": flips,
        "other_differences": differing - flips,
        # answers of the server without speculation that differ between its first and last run
        # (many clients: what shares a step, and so a kernel's choice by row count, varies with timing)
        "off_runs_differ": sum(a != s["text"] for a, s in zip(first_off, answers["off"])),
        "tokens_compared": sum(s["tokens"] for s in answers["off"]),
    }


async def _streams(server: Server, asks: list[tuple[str, str]], tokens: int) -> dict[str, Any]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=3600,
                         http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=3600))  # fmt: skip
    try:
        began = time.perf_counter()
        streams = await asyncio.gather(*(_stream(client, server.model, name, text, tokens) for name, text in asks))
        wall = time.perf_counter() - began
    finally:
        await client.close()
    return {"streams": streams, "tok_s": sum(s["tokens"] for s in streams) / wall}


async def _stream(client: Any, model: str, name: str, text: str, tokens: int) -> dict[str, Any]:
    arrivals, pieces, count = [], [], 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=tokens, stream=True,
        stream_options={"include_usage": True}, **SAMPLED.get(name, {"temperature": 0}))  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    return {"name": name, "text": "".join(pieces), "tokens": count,
            "decode_tok_s": (count - 1) / span if span > 0 else 0.0}  # fmt: skip


def _speculation_counters(server: Server) -> dict[str, float]:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=10).text
    names = {"windows": "seamline_speculative_windows_total", "drafted": "seamline_speculative_draft_tokens_total",
             "accepted": "seamline_speculative_accepted_tokens_total"}  # fmt: skip
    values = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines() if line.startswith("seamline_spec")}
    return {key: values.get(name, 0.0) for key, name in names.items()}


def _differences(off: Server, asks: list[tuple[str, str]], answers: dict[str, list[dict[str, Any]]],
                 tokens: int) -> tuple[int, int]:  # fmt: skip
    """(near-tie flips, answers that differ): a differing answer is a near tie when, in the run
    without speculation, the top two log-probabilities where the texts part are within NEAR_TIE."""
    flips = differing = 0
    for (name, text), plain, drafted in zip(asks, answers["off"], answers["auto"]):
        if plain["text"] == drafted["text"]:
            continue
        differing += 1
        flips += _near_tie_where_they_part(off, name, text, drafted["text"], tokens)
    return flips, differing


def _near_tie_where_they_part(off: Server, name: str, text: str, other: str, tokens: int) -> bool:
    body = {"model": off.model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
            "logprobs": True, "top_logprobs": 2, **SAMPLED.get(name, {"temperature": 0})}  # fmt: skip
    reply = httpx.post(off.url + "/chat/completions", json=body, timeout=600).json()
    done = ""
    for entry in reply["choices"][0]["logprobs"]["content"]:
        if not other.startswith(done + entry["token"]):
            top = entry["top_logprobs"]
            return len(top) == 2 and top[0]["logprob"] - top[1]["logprob"] < NEAR_TIE
        done += entry["token"]
    return False


def _result(rows: dict[str, dict[str, Any]], repeats: int, tokens: int, logs: Path) -> dict[str, Any]:
    compared = list(rows.values())
    return {
        "bench": "spec",
        "model": "embedded (SmolLM2-135M-Instruct Q4_1), default precision",
        "threads": THREADS,
        "repeats": repeats,
        "max_tokens": tokens,
        "workloads": {name: {"prompt": text, "sampling": SAMPLED.get(name, {"temperature": 0})}
                      for name, text in WORKLOADS.items()},  # fmt: skip
        "one_node": rows,
        "mesh_lan": MESH_NOT_RUN,
        "mesh_wan": MESH_NOT_RUN,
        "edit_gain_1node": rows["edit"]["ratio"],
        "edit_mesh_vs_1node": None,
        "edit_gain_wan": None,
        "open_ratio_min": rows["open"]["ratio"],
        "auto_vs_off_16": rows["clients_16"]["ratio"],
        "outputs_identical": all(r["outputs_identical"] for r in compared),
        "tokens_compared": sum(r["tokens_compared"] for r in compared),
        "near_tie_flips": sum(r["near_tie_flips"] for r in compared),
        "logs": str(logs),
    }
