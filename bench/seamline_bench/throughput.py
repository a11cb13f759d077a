"""`seamline bench throughput`: streaming clients through the OpenAI API, seamline as a user
gets it beside llama.cpp at its best.

Two GGUF models: the embedded SmolLM2 (Q4_1) and `bench quant`'s random 1.1B Llama in
llama.cpp's Q4_K_M mix (written once and cached). Each client streams its own prompt (distinct,
32-256 tokens) and gets ``tokens`` (128) tokens with ``ignore_eos``; a figure is the generated
tokens/s of all clients together over the wave's wall time (prefill included), with p50/p95
time to first token and inter-token gap. The parties, all on cores 0-1 with 2 threads:

* ``seamline``: `seamline serve --single --model X` with no flag and no ``SEAMLINE_*``
  variable (``SEAMLINE_CACHE`` aside): the default path. Embedded: 1, 4, 16, 64 clients;
  1.1B: 1 and 16;
* ``seamline_exact`` (1.1B, 1 and 16 clients): the same with ``--precision exact``;
* ``mesh_2_stages`` (embedded, 1 client): `seamline serve --no-local-node` and two `seamline
  join` nodes on loopback, under a memory cap that makes them two stages; coordinator, nodes
  and client all on cores 0-1, each node with 2 threads, as `serve --single`: at one client
  one stage works at a time, so the figure prices the hops and the coordinator;
* ``llamacpp_16``: `llama-server --parallel 16` for 1 to 16 clients, ``llamacpp_64``:
  ``--parallel 64`` for 64, each slot 256 + ``tokens`` + 64 long (``llama_server``: built with
  AVX-512 and no AMX, repacking on; the JSON's ``llama_cpp`` says which build ran).

All servers run side by side (started one at a time); each of ``repeats`` (3) rounds measures
every party at every client count in turn, with fresh prompts (no server answers from a
prompt cache), and a figure is the median of the rounds. Each round also times the engine
alone (``quant_driver``'s default party, cores 0-1, 2 threads) decoding after the 1-client
prompt: ``single_stream_ratio`` is the median over rounds of that stream's decode rate
through the API (tokens after the first over the time from the first to the last) over the
engine's. Ratios and ``targets`` are in ``throughput_result``. Each round waits (up to 2 min)
for a quiet machine and ``machine`` reports, per round, the CPU share processes outside the
bench took (``machine_load``): figures from a round another process shared say little.

Left out to keep a run near half an hour on two cores: the one-core mesh, two one-core stages
at 64 clients and the emulated-LAN mesh of earlier versions (`bench split` measures a stage
hop, on loopback and on the emulated LAN), and 4 or 64 clients on the 1.1B.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from seamline_bench.servers import NodeSpec, Server, start_llama, start_mesh, start_single
from seamline_bench.throughput_result import Runs, result

CLIENTS = (1, 4, 16, 64)  # the embedded model
CLIENTS_1B = (1, 16)
PROMPT_TOKENS = (32, 256)
MAX_TOKENS = 128
THREADS = 2
SLOTS = (
    16,
    64,
)  # llama-server's --parallel: the smaller serves up to its count, the larger the rest
QUIET_WAIT_S = 120.0  # at most this long before a round for the machine to be quiet
KEPT_VARIABLES = (
    "SEAMLINE_CACHE",
)  # where built kernels are kept; every other SEAMLINE_* is dropped


@dataclass(frozen=True)
class Party:
    """One server of one model, measured at ``clients`` client counts."""

    model: str  # "embedded" | "llama_1b"
    name: str
    clients: tuple[int, ...]
    start: Callable[[], Server]


def bench_throughput(
    repeats: int = 3,
    tokens: int = MAX_TOKENS,
    clients: tuple[int, ...] = CLIENTS,
    clients_1b: tuple[int, ...] = CLIENTS_1B,
) -> dict[str, Any]:
    from seamline.app import default_model_path
    from seamline_bench.llama_server import llama_cpp_build
    from seamline_bench.quant import llama_1b_path

    logs = Path(tempfile.mkdtemp(prefix="seamline-throughput-"))
    build, why = llama_cpp_build()
    ggufs = {"embedded": default_model_path(), "llama_1b": llama_1b_path()}
    parties, missing = plan_parties(
        ggufs, build.server if build else None, why, logs, clients, clients_1b, tokens
    )
    runs: Runs = {p.model: {} for p in parties}
    engine: list[float] = []
    machine: list[dict[str, float]] = []
    servers: dict[Party, Server] = {}
    if threading.current_thread() is threading.main_thread():
        signal.signal(
            signal.SIGTERM, _exit
        )  # a bench told to stop still stops its servers (finally)
    try:
        servers = start_all(parties, logs)
        for round_ in range(repeats):
            machine.append(
                _measured_round(round_, servers, runs, engine, ggufs["embedded"], tokens, logs)
            )
    finally:
        for server in servers.values():
            server.close()
    build_info = build.describe() if build else {"unavailable": why}
    out = result(
        runs, engine, missing, tokens, repeats, list(PROMPT_TOKENS), build_info, str(logs), machine
    )
    for model, path in ggufs.items():
        out["models"].setdefault(model, {})["gguf"] = path.name
    return out


def _exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def seamline_env() -> dict[str, str]:
    """This environment less every ``SEAMLINE_*`` variable but ``KEPT_VARIABLES``: the defaults."""
    return {
        k: v for k, v in os.environ.items() if not k.startswith("SEAMLINE_") or k in KEPT_VARIABLES
    }


def plan_parties(
    ggufs: dict[str, Path],
    llama_server: Path | None,
    why: str,
    logs: Path,
    clients: tuple[int, ...],
    clients_1b: tuple[int, ...],
    tokens: int,
) -> tuple[list[Party], dict[str, str]]:
    """Every party that will run, and why any other will not."""
    env, missing = seamline_env(), {}
    embedded, big = ggufs["embedded"], ggufs["llama_1b"]
    parties = [
        Party(
            "embedded",
            "seamline",
            clients,
            lambda: start_single(
                "embedded-seamline", THREADS, env, logs, precision=None, model=embedded
            ),
        ),
        Party(
            "embedded",
            "mesh_2_stages",
            tuple(n for n in clients if n == 1),
            lambda: _mesh(env, logs),
        ),
        Party(
            "llama_1b",
            "seamline",
            clients_1b,
            lambda: start_single(
                "llama_1b-seamline", THREADS, env, logs, precision=None, model=big
            ),
        ),
        Party(
            "llama_1b",
            "seamline_exact",
            clients_1b,
            lambda: start_single(
                "llama_1b-seamline_exact", THREADS, env, logs, precision="exact", model=big
            ),
        ),
    ]
    for model, counts in (("embedded", clients), ("llama_1b", clients_1b)):
        for slots, served in _llama_slots(counts).items():
            if llama_server is None:
                missing[f"{model}.llamacpp_{slots}"] = why
                continue
            start = _llama_start(model, slots, llama_server, ggufs[model], tokens, logs)
            parties.append(Party(model, f"llamacpp_{slots}", served, start))
    return [p for p in parties if p.clients], missing


def _llama_slots(counts: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    """``--parallel`` -> the client counts that server serves: 1 to 16 the first, more the second."""
    small = tuple(n for n in counts if n <= SLOTS[0])
    large = tuple(n for n in counts if n > SLOTS[0])
    return {s: c for s, c in ((SLOTS[0], small), (max(SLOTS[1], *large, 0), large)) if c}


def _llama_start(
    model: str, slots: int, binary: Path, gguf: Path, tokens: int, logs: Path
) -> Callable[[], Server]:
    context_per_slot = PROMPT_TOKENS[1] + tokens + 64
    return lambda: start_llama(
        f"{model}-llamacpp_{slots}", binary, gguf, THREADS, slots, context_per_slot, logs
    )


def _mesh(env: dict[str, str], logs: Path) -> Server:
    """Two stages of the embedded model on loopback, every process on cores 0-1."""
    from seamline.server.demo import memory_cap_gb

    cap = memory_cap_gb(None, 2, 2048, dtype_bytes=2)
    both = NodeSpec("0,1", THREADS)
    return start_mesh(
        "embedded-mesh_2_stages", [both, both], both, "127.0.0.1", env, logs, cap, precision=None
    )


def start_all(parties: list[Party], logs: Path) -> dict[Party, Server]:
    """Every party's server, started one at a time, each healthy and warm before the next: a mesh
    node measures its speed as it joins, and the plan follows what it measured."""
    servers: dict[Party, Server] = {}
    try:
        for party in parties:
            servers[party] = party.start()
            servers[party].wait_healthy()
            wave(servers[party], prompts_file(1, 9999, logs), 8)  # warm-up
    except BaseException:
        for server in servers.values():
            server.close()
        raise
    return servers


def _measured_round(
    round_: int,
    servers: dict[Party, Server],
    runs: Runs,
    engine: list[float],
    embedded: Path,
    tokens: int,
    logs: Path,
) -> dict[str, float]:
    """One round, begun on a quiet machine if one comes within ``QUIET_WAIT_S``: how long it
    waited and the CPU share other processes took during the round (``machine_load``)."""
    from seamline_bench.machine_load import Meter, wait_quiet

    def pids() -> list[int]:
        return [proc.pid for server in servers.values() for proc in server.procs]

    waited, _ = wait_quiet(pids, QUIET_WAIT_S)
    meter = Meter(pids)
    meter.start()
    _round(round_, servers, runs, engine, embedded, tokens, logs)
    return {"waited_for_quiet_s": waited, "foreign_cpu_share": meter.stop()}


def _round(
    round_: int,
    servers: dict[Party, Server],
    runs: Runs,
    engine: list[float],
    embedded: Path,
    tokens: int,
    logs: Path,
) -> None:
    """One round: the engine alone on the 1-client prompt, then every party at every count."""
    counts = sorted({n for p in servers for n in p.clients})
    first = prompts_file(1, round_ * 1000 + 1, logs)
    engine.append(engine_decode_rate(embedded, json.loads(first.read_text())[0], tokens))
    for n in counts:
        prompts = first if n == 1 else prompts_file(n, round_ * 1000 + n, logs)
        for party, server in servers.items():
            if n in party.clients:
                done = wave(server, prompts, tokens)
                runs[party.model].setdefault(party.name, {}).setdefault(n, []).append(done)
                print(
                    f"round {round_} {party.model} {party.name} {n} clients: {done['tok_s']:.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )


def prompts_file(count: int, seed: int, logs: Path) -> Path:
    """``count`` distinct prompts of 32-256 tokens (the embedded tokenizer, which both models use)."""
    from seamline.app import default_model_path
    from seamline.text import TextCodec
    from seamline_bench.load import make_prompts

    codec = TextCodec.from_model(default_model_path(), ())
    texts = make_prompts(count, *PROMPT_TOKENS, seed, codec.encode)
    path = logs / f"prompts-{seed}-{count}.json"
    path.write_text(json.dumps(texts))
    return path


def wave(server: Server, prompts: Path, tokens: int) -> dict[str, Any]:
    """One wave of streaming clients, one per prompt in ``prompts``, from a load-generator process."""
    count = len(json.loads(prompts.read_text()))
    command = [
        *server.client_prefix,
        "taskset",
        "-c",
        server.client_cores,
        sys.executable,
        "-m",
        "seamline_bench.load",
        server.url,
        server.model,
        str(count),
        str(prompts),
        str(tokens),
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"load generator against {server.name} failed: {out.stderr[-2000:]}")
    done = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    if done["failed"]:
        raise RuntimeError(
            f"{server.name}: {done['failed']} of {count} streams failed: {done['errors']}"
        )
    return done


def engine_decode_rate(gguf: Path, prompt: str, tokens: int) -> float:
    """The engine's own greedy decode rate (no server, the default path, cores 0-1, 2 threads)
    over ``tokens - 1`` steps after ``prompt`` (as the API encodes a completion's text), in its
    own process: what one stream's tokens after the first cost without the API."""
    from seamline.text import TextCodec
    from seamline_bench.driver import Driver

    ids = TextCodec.from_model(gguf, ()).encode(prompt)
    driver = Driver(
        "seamline_bench.quant_driver",
        ["default", str(gguf), str(THREADS), json.dumps(ids)],
        prefix=["taskset", "-c", "0,1"],
    )
    try:
        driver.wait_ready()
        return float(driver.measure(max(1, tokens - 1))["decode_tok_s"])
    finally:
        driver.close()
