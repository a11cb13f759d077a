"""One measured party of `seamline bench lockstep`, in its own process.

``single``: seamline's Engine on the whole model. ``group``: the leader (rank 0) of a 2-rank
lockstep group, which starts rank 1 with ``python -m seamline.runtime.lockstep_group``. Each rank
is pinned to its own core (``--core``, ``--peer-core``) with one torch thread, so a run is
"two one-core machines" against the single engine's one. A fresh process per party keeps
pinning, thread counts and torch.distributed's one process group per process clean.

``--netns``: first move into a fresh network namespace with only ``lo`` up (needs root), so
the loopback interface's counters hold this group's traffic and nothing else.

Commands on stdin: ``measure TOKENS`` prints one JSON line — greedy decode of the prompt,
timed from the first generated token to the (TOKENS+1)-th, i.e. over TOKENS decode steps;
for a group also the bytes sent during exactly those steps — and ``quit`` ends the process.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def enter_netns() -> str:
    """Move this (still single-threaded) process into a new network namespace and bring up
    ``lo``; "" when done, else why not (the process stays where it was)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        return f"unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh14x", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh14x", b"lo", flags | IFF_UP))
    return ""


def pin(core: int) -> None:
    """This thread onto ``core`` (or fail), then every other thread of the process (best
    effort: one may have exited meanwhile); threads made later inherit it."""
    os.sched_setaffinity(0, {core})
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:
            pass


def lo_tx_bytes() -> int:
    """Bytes sent on ``lo`` in this process's network namespace (headers included)."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])  # 8 receive fields, then transmit bytes
    raise RuntimeError("no lo in /proc/self/net/dev")


def tcp_bytes(pids: list[int]) -> dict[int, tuple[int, int]]:
    """Per pid: the kernel's ``tcpi_bytes_sent`` (TCP payload bytes put on the wire, without
    headers, retransmissions included) and ``tcpi_bytes_retrans``, each summed over that
    process's TCP sockets in this namespace, read with ``ss``."""
    try:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        raise RuntimeError(
            "bench lockstep reads TCP byte counters with `ss` (iproute2): install it"
        ) from None
    totals = {pid: [0, 0] for pid in pids}
    owner: int | None = None
    for line in out.splitlines():
        if not line[:1].isspace():  # a socket line: "... users:(("python",pid=N,fd=M))"
            owner = next((pid for pid in pids if f"pid={pid}," in line), None)
        elif owner is not None:  # its info line
            for field in line.split():
                name, _, value = field.partition(":")
                if name == "bytes_sent":
                    totals[owner][0] += int(value)
                elif name == "bytes_retrans":
                    totals[owner][1] += int(value)
    return {pid: (sent, retrans) for pid, (sent, retrans) in totals.items()}


class TimedComm:
    """Wraps the leader's Comm: seconds spent inside collectives (transfer + waiting for the
    peer to reach the same gate)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.rank, self.world = inner, inner.rank, inner.world
        self.seconds, self.calls = 0.0, 0

    def all_reduce(self, tensor: Any, tag: Any) -> Any:
        began = time.perf_counter()
        try:
            return self.inner.all_reduce(tensor, tag)
        finally:
            self.seconds += time.perf_counter() - began
            self.calls += 1

    def all_gather(self, tensor: Any, dim: int, *args: Any) -> Any:
        began = time.perf_counter()
        try:
            return self.inner.all_gather(tensor, dim, *args)
        finally:
            self.seconds += time.perf_counter() - began
            self.calls += 1

    def close(self) -> None:
        self.inner.close()


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m seamline_bench.lockstep_driver")
    ap.add_argument("mode", choices=["single", "group"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", required=True, help="token ids, comma-separated")
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--peer-core", type=int, default=1)
    ap.add_argument("--transport", choices=["tcp", "torch"], default="tcp")
    ap.add_argument(
        "--tls", action="store_true", help="tcp over mutual TLS, certificates from a fresh mesh CA"
    )
    ap.add_argument("--netns", action="store_true")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    return ap.parse_args()


def _group_certificates() -> Path:
    """A fresh mesh CA and a certificate for each of the two ranks, in a private folder."""
    import tempfile

    from seamline.mesh.identity import MeshAuthority

    folder = Path(tempfile.mkdtemp(prefix="seamline-group-tls-"))
    authority = MeshAuthority.create()
    (folder / "ca.pem").write_text(authority.ca_pem)
    for rank in range(2):
        authority.identity(f"rank{rank}").write(folder, f"rank{rank}")
    return folder


def _start_group(args: argparse.Namespace) -> tuple[Any, subprocess.Popen[bytes], TimedComm | None]:
    """Rank 1 as a subprocess on the peer core, the leader here; the leader's comm timed."""
    from seamline.net.link import free_port
    from seamline.net.tls import group_tls_from_folder
    from seamline.runtime.lockstep_group import LockstepRank
    from seamline.runtime.lockstep_leader import LockstepGroup

    ports = [free_port(), free_port()]
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    root = Path(__file__).resolve().parents[2]
    peer_core = args.peer_core
    tls_dir = _group_certificates() if args.tls else None
    peer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "seamline.runtime.lockstep_group",
            "--rank",
            "1",
            "--world",
            "2",
            "--addresses",
            addresses,
            "--model",
            args.model,
            "--timeout",
            str(args.timeout),
            "--transport",
            args.transport,
            "--dtype",
            args.dtype,
            *(["--tls-dir", str(tls_dir)] if tls_dir else []),
        ],
        cwd=root,
        env={**os.environ},
        preexec_fn=lambda: os.sched_setaffinity(0, {peer_core}),
    )
    from seamline.weights.loader import DTYPES

    try:
        leader = LockstepRank(
            args.model,
            0,
            2,
            [("127.0.0.1", p) for p in ports],
            args.timeout,
            DTYPES[args.dtype],
            transport=args.transport,  # type: ignore[arg-type]
            tls=group_tls_from_folder(tls_dir, 0, 2) if tls_dir else None,
        )
    finally:  # both ranks have read their keys once the group is joined (or failed to)
        if tls_dir is not None:
            shutil.rmtree(tls_dir, ignore_errors=True)
    timed = None
    inner = getattr(leader.comm, "inner", None)
    if inner is not None:  # the leader's comm is a late-bound wrapper; time what it wraps
        timed = TimedComm(inner)
        leader.comm.inner = timed  # type: ignore[attr-defined]
    return LockstepGroup(leader), peer, timed


def _measure(
    runner: Any, prompt: list[int], tokens: int, pids: list[int], timed: TimedComm | None, lo: bool
) -> dict[str, Any]:
    """Greedy decode of ``tokens`` steps after the prompt: rate, and (a group) bytes sent."""
    from seamline.params import SamplingParams

    group = len(pids) > 1
    gen = runner.generate(prompt, SamplingParams(max_tokens=tokens + 1))
    out = [next(gen)]  # after the prefill: the decode steps start here
    sent0 = tcp_bytes(pids) if group else {}
    lo0 = lo_tx_bytes() if lo else None
    comm0 = timed.seconds if timed else 0.0
    start = time.perf_counter()
    result: dict[str, Any] = {}
    for token in gen:
        out.append(token)
        if len(out) == tokens + 1:  # before the generator's one extra step
            wall = time.perf_counter() - start
            result = {"tok_s": tokens / wall, "ms_per_token": wall / tokens * 1e3}
            if timed:
                result["comm_ms_per_token"] = (timed.seconds - comm0) / tokens * 1e3
            if group:
                sent1 = tcp_bytes(pids)
                result["tcp_bytes_sent"] = [sent1[p][0] - sent0[p][0] for p in pids]
                result["tcp_bytes_retrans"] = [sent1[p][1] - sent0[p][1] for p in pids]
                result["lo_tx_bytes"] = lo_tx_bytes() - lo0 if lo0 is not None else None
    if len(out) != tokens + 1:
        raise RuntimeError(f"generated {len(out)} tokens, wanted {tokens + 1}")
    result["tokens"] = out
    return result


def main() -> int:
    args = _args()
    netns = enter_netns() if args.netns else "not requested"  # before any thread exists
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if args.netns:  # c10d warns that a namespace without a hostname cannot name client sockets
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    pin(args.core)

    import torch

    torch.set_num_threads(1)
    prompt = [int(t) for t in args.prompt.split(",")]
    from seamline.runtime.engine import Engine

    peer, timed, group = None, None, None
    if args.mode == "single":
        from seamline.weights.loader import DTYPES, load_stage, open_source

        runner = Engine(load_stage(open_source(args.model), dtype=DTYPES[args.dtype]))
    else:
        from seamline.runtime.group_stage import LockstepStage

        group, peer, timed = _start_group(args)
        runner = Engine(LockstepStage(group), group.context_length)
    pin(args.core)  # threads torch or gloo started meanwhile
    print(
        json.dumps(
            {
                "ready": True,
                "mode": args.mode,
                "netns": netns or "fresh namespace, lo only",
                "threads": torch.get_num_threads(),
            }
        ),
        flush=True,
    )
    pids = [os.getpid()] + ([peer.pid] if peer is not None else [])
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        lo = peer is not None and not netns
        print(json.dumps(_measure(runner, prompt, int(words[1]), pids, timed, lo)), flush=True)
    if group is not None and peer is not None:  # both are set together, in group mode
        group.close()
        try:
            peer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
