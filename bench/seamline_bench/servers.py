"""Servers under a throughput benchmark, each a set of real processes behind one OpenAI URL.

``single``: `seamline serve --single` (one process owns the model). ``mesh``: `seamline serve`
with no local node plus one `seamline join` per node, each node pinned to its cores with its
own thread count, optionally inside a network namespace. ``llama``: llama.cpp's server.
seamline's start functions take the precision to name (``precision_args``): None passes no
flag, what a user gets; a bench that compares answers names ``"exact"``. No ``SEAMLINE_*``
variable chooses a path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from seamline.net.link import free_port

SEAMLINE = [sys.executable, "-m", "seamline.cli"]
MODEL_ALIAS = "default"  # the name every seamline server answers to, whatever it serves


@dataclass
class NodeSpec:
    cores: str  # taskset list, e.g. "0" or "0,1"
    threads: int
    netns: str | None = None  # run inside this network namespace
    device: str | None = None  # `--device` (None: the default, auto)
    max_memory_gb: float | None = None  # its own `--max-memory`, in place of the mesh's cap
    join_extra: tuple[str, ...] = ()  # more `join` options


@dataclass
class Server:
    name: str
    url: str  # the OpenAI base URL, .../v1
    model: str
    client_prefix: list[str]  # how a load generator must be started to reach ``url``
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    client_cores: str = "0,1"  # where the load generator runs (taskset list)
    token: str = ""  # a mesh's invite: more nodes may join with it
    caches: list[Path] = field(
        default_factory=list
    )  # its nodes' fragment caches: gone with it, logs stay

    def wait_healthy(self, timeout_s: float = 900) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{self.name}: {proc.args!r} exited with {proc.returncode}")
            try:
                if _get(self, "/health") == 200:
                    return
            except (OSError, httpx.HTTPError, subprocess.SubprocessError):
                pass  # not listening yet
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy after {timeout_s:.0f} s")

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for (
            cache
        ) in self.caches:  # the model's weights again, per node: a bench's runs would fill the disk
            shutil.rmtree(cache, ignore_errors=True)


def _get(server: Server, path: str) -> int:
    """Status of GET ``path`` on the server's host, from the namespace its clients use."""
    root = server.url.removesuffix("/v1")
    if not server.client_prefix:
        return httpx.get(root + path, timeout=5).status_code
    code = "import httpx,sys; print(httpx.get(sys.argv[1], timeout=5).status_code)"
    out = subprocess.run(
        [*server.client_prefix, sys.executable, "-c", code, root + path],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return int(out.stdout.strip() or 0)


def _pinned(cores: str, threads: int, netns: str | None, command: list[str]) -> list[str]:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return [*prefix, "env", f"OMP_NUM_THREADS={threads}", "taskset", "-c", cores, *command]


def _popen(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    out = log.open("a")
    return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def precision_args(precision: str | None) -> list[str]:
    """`--precision NAME`, or nothing for None: the default a user gets with no flag."""
    return [] if precision is None else ["--precision", precision]


def start_single(
    name: str,
    threads: int,
    env: dict[str, str],
    logs: Path,
    *,
    precision: str | None,
    model: Path | None = None,
    extra: tuple[str, ...] = (),
    speculative: str = "off",
) -> Server:
    """`seamline serve --single` on cores 0..threads-1 (``model``: default the embedded one;
    ``extra``: more options; ``speculative``: its mode, off but in `bench spec`)."""
    port = free_port()
    chosen = ["--model", str(model)] if model else []
    command = _pinned(
        ",".join(map(str, range(threads))),
        threads,
        None,
        [
            *SEAMLINE,
            "serve",
            "--single",
            "--port",
            str(port),
            *chosen,
            *precision_args(precision),
            "--speculative",
            speculative,
            *extra,
        ],
    )
    server = Server(name, f"http://127.0.0.1:{port}/v1", MODEL_ALIAS, [])
    server.procs.append(_popen(command, env, logs / f"{name}.log"))
    return server


def descriptors_capped(limit: int) -> list[str]:
    """A command prefix that starts a process with at most ``limit`` descriptors, hard limit
    too, from its first instruction: a server sizes its listeners for the limit it starts with."""
    return ["prlimit", f"--nofile={limit}:{limit}", "--"]


def start_mesh(
    name: str,
    nodes: list[NodeSpec],
    coordinator: NodeSpec,
    host: str,
    env: dict[str, str],
    logs: Path,
    cap_gb: float | None,
    serve_extra: tuple[str, ...] = (),
    nodes_expected: int = 0,
    *,
    precision: str | None,
    nofile: int = 0,
    speculative: str = "off",
) -> Server:
    """A coordinator (pinned as ``coordinator``; ``serve_extra``: more `serve` options) and one
    pinned node per ``nodes`` entry; it plans once ``nodes_expected`` (default: all) have joined.
    ``precision`` is the coordinator's (None: no flag); the nodes take its choice. ``nofile``:
    every process of the mesh starts with that many descriptors at most. ``speculative``: the
    mesh's mode, off but in `bench spec` (so other benches compare plain decoding)."""
    port, control = free_port(), free_port()
    capped = descriptors_capped(nofile) if nofile else []
    serve = [
        *capped,
        *SEAMLINE,
        "serve",
        "--no-local-node",
        "--nodes-expected",
        str(nodes_expected or len(nodes)),
        "--host",
        host,
        "--port",
        str(port),
        "--control-port",
        str(control),
        "--context",
        "2048",
        *precision_args(precision),
        "--speculative",
        speculative,
        *serve_extra,
    ]
    command = _pinned(coordinator.cores, coordinator.threads, coordinator.netns, serve)
    coordinator_proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    token = _read_token(coordinator_proc, logs / f"{name}.log")
    prefix = ["ip", "netns", "exec", coordinator.netns] if coordinator.netns else []
    server = Server(
        name,
        f"http://{host}:{port}/v1",
        MODEL_ALIAS,
        prefix,
        [coordinator_proc],
        coordinator.cores,
        token,
    )
    for index, node in enumerate(nodes):
        join_node(server, index, node, env, logs, cap_gb, nofile)
    return server


def join_node(
    server: Server,
    index: int,
    node: NodeSpec,
    env: dict[str, str],
    logs: Path,
    cap_gb: float | None,
    nofile: int = 0,
) -> subprocess.Popen[str]:
    """Start node ``index`` (`seamline join`, pinned as ``node``) into the mesh ``server``."""
    name = server.name
    cap_gb = node.max_memory_gb or cap_gb
    cap = ["--max-memory", f"{cap_gb:.3f}"] if cap_gb else []
    device = ["--device", node.device] if node.device else []
    join = [
        *(descriptors_capped(nofile) if nofile else []),
        *SEAMLINE,
        "join",
        server.token,
        "--node-id",
        f"{name}{index}",
        "--quiet",
        "--no-progress",
        *cap,
        *device,
        *node.join_extra,
    ]
    cache = logs / f"cache-{name}{index}"
    server.caches.append(cache)
    node_env = {**env, "SEAMLINE_CACHE": str(cache)}
    proc = _popen(
        _pinned(node.cores, node.threads, node.netns, join),
        node_env,
        logs / f"{name}-node{index}.log",
    )
    server.procs.append(proc)
    return proc


def _read_token(proc: subprocess.Popen[str], log: Path) -> str:
    """The invite token from `seamline serve`'s output; the rest of its output goes to ``log``."""
    assert proc.stdout is not None
    out = log.open("a")
    for line in proc.stdout:
        out.write(line)
        if line.startswith("seamline: join with: seamline join "):
            out.flush()
            threading.Thread(target=_drain, args=(proc.stdout, out), daemon=True).start()
            return line.split()[-1]
    raise RuntimeError(
        f"`seamline serve` exited ({proc.wait()}) before printing an invite; see {log}"
    )


def _drain(stream: object, out: object) -> None:
    for line in stream:  # type: ignore[attr-defined]
        out.write(line)  # type: ignore[attr-defined]
        out.flush()  # type: ignore[attr-defined]


def start_llama(
    name: str, binary: Path, gguf: Path, threads: int, slots: int, context_per_slot: int, logs: Path
) -> Server:
    """llama.cpp's `llama-server --parallel slots` on cores 0..threads-1."""
    from seamline_bench.llama_server import server_command

    port = free_port()
    command = [
        "taskset",
        "-c",
        ",".join(map(str, range(threads))),
        *server_command(binary, gguf, port, threads, slots, context_per_slot),
    ]
    server = Server(name, f"http://127.0.0.1:{port}/v1", "llama-server", [])
    server.procs.append(_popen(command, dict(os.environ), logs / f"{name}.log"))
    return server
