"""`seamline bench fuzz`: a running 2-stage mesh under generated inputs on every listening surface.

The mesh is ``split_driver`` (the coordinator and the API in one process, its two stage nodes
as their own processes); a lockstep rank's comm port is ``fuzz_comm_target``. Surfaces:

- ``http_api``: the OpenAI API's bodies and headers (and raw bytes before the HTTP parser);
- ``fragments``: fragment requests, with a member's token and without;
- ``control``: the coordinator's control port, before the join (plaintext, TLS without a join)
  and after it (a member joined with an invite after the plan: never planned);
- ``data_upstream`` / ``data_last``: stage 1's data port as its upstream (hidden frames, session
  messages) and stage 0's as the last stage (tokens), with the right certificate and link key;
  before the handshake, as a member the plan does not name or with no certificate;
- ``lockstep_comm``: a comm port's HELLO and gate headers, before TLS and after it.

Inputs (``fuzz_inputs``) mix random bytes, truncations, oversized length fields and valid
frames with one field mutated. Then up to ``slow`` half-open connections are held at once.
After each quarter of a surface's inputs the mesh must give its greedy answer from before the
fuzzing within ``HANG_S`` (else a hang). ``crashes``: processes that died, plus exceptions no
handler caught (``Exception in thread`` in their logs). RSS growth is from after a warm-up
(every stage's kept prefix KV settled); open descriptors are counted beside it, per surface.

``attacks`` (``bench.attacks``): known attacks, each on a live 3-node mesh serving 8 streaming
clients. ``only``: "surfaces" or "attacks" runs one part alone.
"""

from __future__ import annotations

import resource
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from seamline.mesh.identity import MeshAuthority
from seamline.net.link import free_port
from seamline.runtime.prefix_cache import PREFIX_CACHE_BYTES
from seamline_bench.driver import Driver
from seamline_bench.fuzz_inputs import Inputs
from seamline_bench.fuzz_surfaces import (
    Target,
    comm_surface,
    control_surface,
    data_surface,
    http_surface,
)

HANG_S = 10.0
QUESTION = {
    "model": "default",
    "prompt": "The capital of France is",
    "max_tokens": 8,
    "temperature": 0,
}
SURFACES = ("http_api", "fragments", "control", "data_upstream", "data_last", "lockstep_comm")
CHECKS_PER_SURFACE = 4
TLS_HELLO_START = b"\x16\x03\x01\x02\x00\x01"  # the first bytes of a ClientHello, and no more


def _answer(api: str) -> tuple[str | None, float]:
    """The mesh's greedy answer (None if none came within HANG_S) and how long it took."""
    began = time.monotonic()
    try:
        reply = httpx.post(f"{api}/v1/completions", json=QUESTION, timeout=HANG_S)
        text = reply.json()["choices"][0]["text"] if reply.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError):
        text = None
    return text, time.monotonic() - began


def _send(target: Target, surface: str, inputs: Inputs, count: int) -> int:
    if surface in ("http_api", "fragments"):
        return http_surface(target, inputs, count, fragments=surface == "fragments")
    if surface == "control":
        return control_surface(target, inputs, count)
    if surface in ("data_upstream", "data_last"):
        return data_surface(target, inputs, count, stage=1 if surface == "data_upstream" else 0)
    return comm_surface(target, inputs, count)


def _fill_prefix_cache(api: str, least: int = 1000, most: int = 3000) -> tuple[int, list[int]]:
    """Distinct short requests, at least ``least`` and then until every stage's kept prefix KV
    has settled: fuzzed requests that the API takes leave their KV there, a bounded cache by
    design whose resident size settles only once it has been filled and churned, so RSS is taken
    then. Stage 0 decides what every stage keeps: its kept KV nears its bound, and each later
    stage's (its share of the same requests') stops growing. The number of requests it took,
    and every stage's kept KV bytes then."""
    kept: list[int] = []
    with httpx.Client(base_url=api, timeout=30) as client:
        for i in range(most):
            client.post(
                "/v1/completions",
                json={
                    "model": "default",
                    "prompt": f"Warm-up {i}: tell me about {i * 7919}",
                    "max_tokens": 1,
                    "temperature": 0,
                },
            )
            if i % 50 == 49 and i >= least:
                before, kept = (
                    kept,
                    [s.get("kept_kv_bytes", 0) for s in client.get("/api/status").json()["stages"]],
                )
                settled = len(before) == len(kept) and all(
                    k <= 1.02 * b for k, b in zip(kept[1:], before[1:])
                )
                if kept and kept[0] >= 0.9 * PREFIX_CACHE_BYTES and settled:
                    return i + 1, kept
    return most, kept


def _fds(processes: dict[str, psutil.Process]) -> dict[str, int]:
    """Open descriptors per process: a link kept after its peer left shows here, not in RSS alone."""
    out = {}
    for name, process in processes.items():
        try:
            out[name] = process.num_fds()
        except psutil.Error:
            out[name] = -1
    return out


def _rss_mb(processes: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, process in processes.items():
        try:
            out[name] = process.memory_info().rss / 2**20
        except psutil.Error:
            out[name] = float("nan")
    return out


def _hold_slow(target: Target, count: int) -> list[socket.socket]:
    """``count`` connections spread over the surfaces, each sent a fragment of its first message."""
    host, port = httpx.URL(target.api).host, httpx.URL(target.api).port or 80
    ports = [
        ((host, port), b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"),
        (target.control, TLS_HELLO_START),
        (target.stages[0][1], TLS_HELLO_START),
        (target.stages[1][1], TLS_HELLO_START),
        (target.comm, TLS_HELLO_START),
    ]
    held = []
    for i in range(count):
        address, opening = ports[i % len(ports)]
        try:
            sock = socket.create_connection(address, timeout=5)
            sock.sendall(opening)
            held.append(sock)
        except OSError:
            pass
    return held


def _target(driver: Driver, comm_port: int, comm_tls: Path) -> Target:
    s = driver.ask("secrets")
    return Target(
        api=s["api"],
        control=tuple(s["control"]),
        plan_id=s["plan_id"],
        link_key=s["link_key"],
        stages=[(n, tuple(a)) for n, a in s["stages"]],
        authority=MeshAuthority.load_or_create(Path(s["state_dir"])),
        fragment_token=s["fragment_token"],
        invite=s["invite"],
        hidden_size=s["hidden_size"],
        comm=("127.0.0.1", comm_port),
        comm_tls=comm_tls,
    )  # type: ignore[arg-type]


def bench_fuzz(
    inputs_per_surface: int = 100_000,
    slow: int = 1000,
    seed: int = 0,
    surfaces: tuple[str, ...] = SURFACES,
    only: str | None = None,
    attacks: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """The surfaces' figures and ``attacks`` (``bench.attacks``); ``only``: "surfaces" or "attacks";
    ``attacks``: those of the known attacks to run (all by default)."""
    result: dict[str, Any] = {"bench": "fuzz"}
    if only != "attacks":
        result.update(_surfaces(inputs_per_surface, slow, seed, surfaces))
    if only != "surfaces":
        from seamline_bench.attacks import bench_attacks, setup

        result["attacks"] = bench_attacks(attacks=attacks) if attacks else bench_attacks()
        result["attacks_setup"] = setup()
    return result


def _surfaces(
    inputs_per_surface: int, slow: int, seed: int, surfaces: tuple[str, ...]
) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    work = Path(tempfile.mkdtemp(prefix="seamline-fuzz-"))
    logs = {"mesh": (work / "mesh.log").open("w"), "comm": (work / "comm.log").open("w")}
    comm_tls = _comm_certificates(work / "comm-tls")
    comm_port = free_port()
    driver = Driver("seamline_bench.split_driver", [], stderr=logs["mesh"])
    comm = Driver(
        "seamline_bench.fuzz_comm_target",
        ["--port", str(comm_port), "--tls-dir", str(comm_tls)],
        stderr=logs["comm"],
    )
    try:
        driver.wait_ready()
        comm.wait_ready()
        return _run(
            driver,
            comm,
            _target(driver, comm_port, comm_tls),
            inputs_per_surface,
            slow,
            seed,
            surfaces,
            work,
        )
    finally:
        driver.close()
        comm.proc.kill()
        for log in logs.values():
            log.close()


def _comm_certificates(folder: Path) -> Path:
    folder.mkdir(parents=True)
    authority = MeshAuthority.create()
    (folder / "ca.pem").write_text(authority.ca_pem)
    for rank in range(2):
        authority.identity(f"rank{rank}").write(folder, f"rank{rank}")
    return folder


def _run(
    driver: Driver,
    comm: Driver,
    target: Target,
    count: int,
    slow: int,
    seed: int,
    surfaces: tuple[str, ...],
    work: Path,
) -> dict[str, Any]:
    """Warm up, take RSS, fuzz each surface with answer checks, hold the slow connections."""
    processes = _processes(driver, comm)
    tally = _Tally(_answer(target.api)[0])
    inputs = Inputs(seed)
    warm_requests, kept = _fill_prefix_cache(target.api)
    for surface in surfaces:  # warm-up: every code path once, before RSS is taken
        _send(target, surface, inputs, max(50, count // 100))
    before, fds_before = _rss_mb(processes), _fds(processes)
    started = time.monotonic()
    fuzzed = _fuzz_surfaces(target, surfaces, inputs, count, processes, before, fds_before, tally)
    held = _hold_slow(target, slow)
    tally.check(target.api)
    for sock in held:
        sock.close()
    time.sleep(1.0)
    text, _ = _answer(target.api)
    after = _rss_mb(processes)
    stages = httpx.get(f"{target.api}/api/status", timeout=HANG_S).json()["stages"]
    dead, uncaught = _dead(processes), _uncaught(work)
    return {
        "bench": "fuzz",
        "inputs_per_surface": fuzzed["sent"],
        "crashes": len(dead) + uncaught,
        "crashed_processes": dead,
        "uncaught_exceptions": uncaught,
        "hangs": tally.hangs,
        "wrong_answers": tally.wrong,
        "slowest_answer_s": round(tally.slowest, 2),
        "rss_growth_mb": {name: round(after[name] - before[name], 1) for name in processes},
        "rss_mb_after": {name: round(v, 1) for name, v in after.items()},
        "rss_growth_mb_after_each_surface": fuzzed["growth"],
        "fd_growth_after_each_surface": fuzzed["fd_growth"],
        "stages_after": [
            {k: s.get(k) for k in ("node_id", "sequences", "kv_bytes", "kept_kv_bytes")}
            for s in stages
        ],
        "answers_correct_after": text == tally.expected and tally.expected is not None,
        "warm_up": f"{warm_requests} distinct requests (stage 0's kept prefix KV near its "
        f"{PREFIX_CACHE_BYTES >> 20} MiB bound, every later stage's settled), then 1% of each surface's inputs",
        "kept_kv_mb_after_warm_up": [round(k / 2**20, 1) for k in kept],
        "slow_connections_held": len(held),
        "seconds": round(time.monotonic() - started, 1),
        "seconds_per_surface": fuzzed["seconds"],
        "seed": seed,
        "logs": str(work),
    }


@dataclass
class _Tally:
    """The answer checks so far: hangs (no answer within HANG_S), wrong answers, the slowest."""

    expected: str | None
    hangs: int = 0
    wrong: int = 0
    slowest: float = 0.0

    def check(self, api: str) -> None:
        text, took = _answer(api)
        self.hangs += text is None
        self.wrong += text is not None and text != self.expected
        self.slowest = max(self.slowest, took)


def _processes(driver: Driver, comm: Driver) -> dict[str, psutil.Process]:
    """The coordinator, the comm target and the coordinator's children (its stage nodes)."""
    processes = {
        "coordinator": psutil.Process(driver.proc.pid),
        "comm_target": psutil.Process(comm.proc.pid),
    }
    for child in processes["coordinator"].children():
        processes[f"node{len(processes) - 2}"] = child
    return processes


def _fuzz_surfaces(
    target: Target,
    surfaces: tuple[str, ...],
    inputs: Inputs,
    count: int,
    processes: dict[str, psutil.Process],
    before: dict[str, float],
    fds_before: dict[str, int],
    tally: _Tally,
) -> dict[str, dict[str, Any]]:
    """Each surface's inputs in CHECKS_PER_SURFACE parts, the answer checked after each; per
    surface: inputs sent, seconds, and RSS and open descriptors gained so far."""
    sent: dict[str, int] = {}
    seconds: dict[str, float] = {}
    growth: dict[str, dict[str, float]] = {}  # RSS growth so far, after each surface
    fd_growth: dict[str, dict[str, int]] = {}  # open descriptors gained so far, after each surface
    for surface in surfaces:
        sent[surface], began = 0, time.monotonic()
        for _ in range(CHECKS_PER_SURFACE):
            sent[surface] += _send(target, surface, inputs, count // CHECKS_PER_SURFACE)
            tally.check(target.api)
        seconds[surface] = round(time.monotonic() - began, 1)
        growth[surface] = {k: round(v - before[k], 1) for k, v in _rss_mb(processes).items()}
        fd_growth[surface] = {k: v - fds_before[k] for k, v in _fds(processes).items()}
    return {"sent": sent, "seconds": seconds, "growth": growth, "fd_growth": fd_growth}


def _dead(processes: dict[str, psutil.Process]) -> list[str]:
    """The processes that are gone or zombies."""
    return [
        name
        for name, p in processes.items()
        if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    ]


def _uncaught(work: Path) -> int:
    """Exceptions no handler caught, as the logs under ``work`` tell them."""
    return sum(
        path.read_text(errors="replace").count("Exception in thread") for path in work.glob("*.log")
    )
