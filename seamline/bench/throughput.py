"""`seamline bench throughput`: many streaming clients through the OpenAI API.

On the embedded model (its Q4_1 GGUF; seamline in bfloat16 with int8 activation blocks in the
matmuls, as llama.cpp multiplies), for 1, 4, 16 and 64 concurrent clients (distinct prompts
of 32-256 tokens, 128 generated tokens each with ``ignore_eos``), aggregate generated tokens/s
(over the wave's wall time, prefill included) and p50/p95 time to first token and
inter-token gap, for:

* ``one_node``: `seamline serve --single` on cores 0-1, 2 threads;
* ``one_core``: a mesh of one node pinned to core 0 (one thread);
* ``two_stages``: a mesh of two stage nodes pinned to cores 0 and 1 (one thread each);
* ``two_stages_lan``: the same with the nodes in two network namespaces joined by an emulated
  1 GbE link (0.25 ms one way, shared/netns.sh; needs root and iptables);
* ``llamacpp``: llama.cpp's `llama-server --parallel 64` on the same GGUF, cores 0-1, 2 threads.

The mesh coordinator and its load generator run on core 0, beside the first node, in (b) and
(c) alike (two_stages then has one core shared and one free, one_core one shared and one
idle); against `serve --single` and llama-server the load generator may use both cores.
All servers run side by side; each round measures every configuration at every client count
in turn, with fresh prompts per round (no server can answer from a prompt cache); medians of
the rounds are reported. ``single_stream_ratio`` divides one client's rate through the API by
the engine's own decode rate (no server, same threads), measured in the same rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from seamline.bench.servers import NodeSpec, Server, start_llama, start_mesh, start_single

CLIENTS = (1, 4, 16, 64)
PROMPT_TOKENS = (32, 256)
MAX_TOKENS = 128
DTYPE = "bfloat16"
CONFIGS = ("one_node", "one_core", "two_stages", "two_stages_lan", "llamacpp")


def bench_throughput(repeats: int = 2, tokens: int = MAX_TOKENS, clients: tuple[int, ...] = CLIENTS) -> dict[str, Any]:
    from seamline.app import default_model_path
    from seamline.bench.split import lan_down, lan_up

    env = {**os.environ, "SEAMLINE_QUANT_ACTIVATIONS": "int8", "SEAMLINE_BENCH_DTYPE": DTYPE}
    logs = Path(tempfile.mkdtemp(prefix="seamline-throughput-"))
    gguf = default_model_path()
    lan_reason = lan_up()
    servers, missing = _start_all(gguf, env, logs, lan_reason)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {name: {n: [] for n in clients} for name in servers}
    engine_runs: list[float] = []
    try:
        for server in servers.values():
            server.wait_healthy()
            _wave(server, _prompts(1, 9999, logs), 8)  # warm-up
        for round_ in range(repeats):
            engine_runs.append(_engine_decode_rate(gguf, tokens))
            for n in clients:
                prompts = _prompts(n, round_ * 1000 + n, logs)
                for name, server in servers.items():
                    runs[name][n].append(_wave(server, prompts, tokens))
                    print(f"round {round_} {name} {n} clients: {runs[name][n][-1]['tok_s']:.1f} tok/s",
                          file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for server in servers.values():
            server.close()
        lan_down()
    return _result(runs, engine_runs, missing, tokens, repeats, logs)


def _start_all(gguf: Path, env: dict[str, str], logs: Path, lan_reason: str) -> tuple[dict[str, Server], dict[str, str]]:
    """Every configuration's server, started one at a time, each healthy before the next: a
    node measures its speed as it joins, and the plan follows what it measured."""
    from seamline.bench.llama_server import llama_server_binary
    from seamline.server.demo import memory_cap_gb

    cap = memory_cap_gb(None, 2, 2048, dtype_bytes=2)
    beside = NodeSpec("0", 1)  # the coordinator and the clients: on core 0 with the first node, in (b) and (c)
    starts: dict[str, Callable[[], Server]] = {
        "one_node": lambda: start_single("one_node", 2, env, logs),
        "one_core": lambda: start_mesh("one_core", [NodeSpec("0", 1)], beside, "127.0.0.1", env, logs, None),
        "two_stages": lambda: start_mesh("two_stages", [NodeSpec("0", 1), NodeSpec("1", 1)], beside, "127.0.0.1",
                                         env, logs, cap),
    }  # fmt: skip
    missing: dict[str, str] = {}
    if lan_reason:
        missing["two_stages_lan"] = lan_reason
    else:
        nodes = [NodeSpec("0", 1, "slb1"), NodeSpec("1", 1, "slb2")]
        coordinator = NodeSpec("0", 1, "slb1")
        starts["two_stages_lan"] = lambda: start_mesh("two_stages_lan", nodes, coordinator, "10.77.0.1", env, logs, cap)
    binary, why = llama_server_binary()
    if binary is None:
        missing["llamacpp"] = why
    else:
        context_per_slot = PROMPT_TOKENS[1] + MAX_TOKENS + 64
        starts["llamacpp"] = lambda: start_llama(binary, gguf, 2, max(CLIENTS), context_per_slot, logs)
    servers: dict[str, Server] = {}
    try:
        for name, start in starts.items():
            servers[name] = start()
            servers[name].wait_healthy()
    except BaseException:
        for server in servers.values():
            server.close()
        raise
    return servers, missing


def _prompts(count: int, seed: int, logs: Path) -> Path:
    from seamline.app import default_model_path
    from seamline.bench.load import make_prompts
    from seamline.text import TextCodec

    codec = TextCodec.from_model(default_model_path(), ())
    texts = make_prompts(count, *PROMPT_TOKENS, seed, codec.encode)
    path = logs / f"prompts-{seed}.json"
    path.write_text(json.dumps(texts))
    return path


def _wave(server: Server, prompts: Path, tokens: int) -> dict[str, Any]:
    count = len(json.loads(prompts.read_text()))
    command = [*server.client_prefix, "taskset", "-c", server.client_cores, sys.executable, "-m", "seamline.bench.load",
               server.url, server.model, str(count), str(prompts), str(tokens)]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"load generator against {server.name} failed: {out.stderr[-2000:]}")
    wave = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    if wave["failed"]:
        raise RuntimeError(f"{server.name}: {wave['failed']} of {count} streams failed: {wave['errors']}")
    return wave


def _engine_decode_rate(gguf: Path, tokens: int) -> float:
    """The engine's own greedy decode rate on 2 threads (no server, int8 activation blocks as
    the servers here), in its own process."""
    from seamline.bench.driver import Driver
    from seamline.text import TextCodec

    prompt = TextCodec.from_model(gguf, ()).encode("Write a short story about a lighthouse keeper.")
    driver = Driver("seamline.bench.quant_driver", ["quantized", str(gguf), DTYPE, "2", json.dumps(prompt)],
                    prefix=["taskset", "-c", "0,1"])  # fmt: skip
    try:
        driver.wait_ready()
        return float(driver.measure(tokens)["decode_tok_s"])
    finally:
        driver.close()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def _cell(waves: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One configuration at one client count: median rate, pooled latency percentiles."""
    if not waves:
        return None
    ttft = [t for w in waves for t in w["ttft_ms"]]
    itl = [t for w in waves for t in w["itl_ms"]]
    return {
        "tok_s": round(statistics.median(w["tok_s"] for w in waves), 2),
        "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p95_ms": _pct(ttft, 0.95),
        "itl_p50_ms": _pct(itl, 0.5), "itl_p95_ms": _pct(itl, 0.95),
        "runs_tok_s": [round(w["tok_s"], 2) for w in waves],
    }  # fmt: skip


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    return round(a["tok_s"] / b["tok_s"], 3) if a and b else None


def _result(runs: dict[str, dict[int, list[dict[str, Any]]]], engine_runs: list[float], missing: dict[str, str],
            tokens: int, repeats: int, logs: Path) -> dict[str, Any]:  # fmt: skip
    table = {name: {str(n): _cell(waves) for n, waves in by_n.items()} for name, by_n in runs.items()}

    def cell(name: str, n: int) -> dict[str, Any] | None:
        return table.get(name, {}).get(str(n))

    engine = statistics.median(engine_runs) if engine_runs else None
    single = cell("one_node", 1)
    return {
        "bench": "throughput",
        "model": "SmolLM2-135M-Instruct.Q4_1 (GGUF), seamline in bfloat16 with int8 activation blocks",
        "generated_tokens_per_client": tokens, "prompt_tokens": list(PROMPT_TOKENS), "repeats": repeats,
        "configs": table,
        "batch_gain_16": _ratio(cell("one_node", 16), single),
        "vs_llamacpp_16": _ratio(cell("one_node", 16), cell("llamacpp", 16)),
        "pipeline_gain_64": _ratio(cell("two_stages", 64), cell("one_core", 64)),
        "pipeline_gain_lan_64": _ratio(cell("two_stages_lan", 64), cell("one_core", 64)),
        "single_stream_ratio": round(single["tok_s"] / engine, 3) if single and engine else None,
        "engine_decode_tok_s": round(engine, 2) if engine else None,
        "not_measured": missing,
        "logs": str(logs),
    }  # fmt: skip
