"""The live meshes `seamline bench fuzz`'s ``attacks`` run against, and what an attacker is told.

A mesh is chaos's: ``--precision exact`` (float32), nodes on memory caps under which any two
(and no one) hold the model, `seamline serve` with its state directory in the bench's folder
(so the bench is its administrator) and every honest process started with 1024 descriptors,
its hard limit too (a common default; the attacker may open as many as the machine's hard
limit allows). A lying member is a node of
its own process (``attack_liar``), joined with an invite of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from seamline.mesh.control.admin_client import AdminClient
from seamline.mesh.protocol.invite import Invite
from seamline.net.link import free_port
from seamline.server.demo import memory_cap_gb
from seamline_bench.driver import Driver
from seamline_bench.servers import NodeSpec, Server, descriptors_capped, start_mesh

CONTEXT = 2048
HONEST_NOFILE = 1024


@dataclass
class LiveMesh:
    server: Server
    name: str
    logs: Path
    state_dir: Path
    fragments_port: int
    extra: dict[str, subprocess.Popen[Any]] = field(
        default_factory=dict
    )  # honest processes besides the mesh's
    comm_tls: Path | None = None
    comm_port: int = 0  # a lockstep rank's comm port (``fuzz_comm_target``), when there is one
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=15))

    @property
    def api(self) -> str:
        return self.server.url.removesuffix("/v1")

    def status(self) -> dict[str, Any]:
        try:
            return dict(self.http.get(f"{self.api}/api/status").json())
        except (httpx.HTTPError, ValueError):
            return {}

    def honest(self) -> dict[str, subprocess.Popen[Any]]:
        """Every honest process by name: the coordinator, its nodes, and the comm port's rank."""
        out: dict[str, subprocess.Popen[Any]] = {"coordinator": self.server.procs[0]}
        out.update({f"{self.name}{i}": proc for i, proc in enumerate(self.server.procs[1:])})
        return {**out, **self.extra}

    def invite(self) -> str:
        """A new invite, for one attacker (removing a member revokes the invite it joined with)."""
        return str(
            AdminClient(self.state_dir, self.api).call("POST", "invites", {"expires_s": 3600})[
                "token"
            ]
        )

    def remove(self, node_id: str) -> None:
        AdminClient(self.state_dir, self.api).call("DELETE", f"nodes/{node_id}")

    def target(self, duration_s: float) -> dict[str, Any]:
        """What an attacker is told: every listening port of the honest processes."""
        status = self.status()
        nodes = []
        for node in status.get("nodes", []):
            proc = self.honest().get(node["node_id"])
            host, port = node["address"].rsplit(":", 1)
            nodes.append(
                {
                    "node_id": node["node_id"],
                    "data": [host, int(port)],
                    "other_ports": _listening(proc.pid, {int(port)}) if proc else [],
                }
            )
        control = Invite.decode(self.server.token).control_port
        return {
            "api": self.api,
            "control": ["127.0.0.1", control],
            "fragments": ["127.0.0.1", self.fragments_port],
            "nodes": nodes,
            "duration_s": duration_s,
            "comm": ["127.0.0.1", self.comm_port] if self.comm_port else None,
        }

    def close(self) -> None:
        self.server.close()
        for proc in self.extra.values():
            proc.kill()
            proc.wait()


def _listening(pid: int, besides: set[int]) -> list[int]:
    try:
        return sorted(
            {
                c.laddr.port
                for c in psutil.Process(pid).net_connections("tcp")
                if c.status == psutil.CONN_LISTEN
            }
            - besides
        )
    except psutil.Error:
        return []


def start(
    name: str,
    logs: Path,
    honest_nodes: int = 3,
    nodes_expected: int = 0,
    verify_fraction: float = 0.0,
    comm_tls: Path | None = None,
) -> LiveMesh:
    """A mesh of ``honest_nodes`` (named NAME0, NAME1, ...), planned once ``nodes_expected``
    have joined (a liar may be one of them); with ``comm_tls``, a lockstep rank's comm port too."""
    env = dict(os.environ)
    logs.mkdir(parents=True, exist_ok=True)
    state_dir, fragments = logs / f"state-{name}", free_port()
    extra = (
        "--state-dir",
        str(state_dir),
        "--fragments-port",
        str(fragments),
        "--verify-fraction",
        str(verify_fraction),
    )
    cap = memory_cap_gb(None, 2, CONTEXT)
    server = start_mesh(
        name,
        [NodeSpec("0,1", 1) for _ in range(honest_nodes)],
        NodeSpec("0,1", 1),
        "127.0.0.1",
        env,
        logs,
        cap,
        extra,
        nodes_expected,
        precision="exact",  # answers compared
        nofile=HONEST_NOFILE,
    )
    mesh = LiveMesh(server, name, logs, state_dir, fragments, comm_tls=comm_tls)
    if comm_tls is not None:
        mesh.comm_port = quiet_port()
        mesh.extra["comm"] = _comm_target(comm_tls, mesh.comm_port, logs)
    return mesh


def quiet_port(low: int = 20000, high: int = 32000) -> int:
    """A free port below the kernel's ephemeral range: a rank listens there again between groups,
    and an outgoing connection of anyone's may take an ephemeral port the moment it is free."""
    import random
    import socket

    for _ in range(100):
        port = random.randrange(low, high)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    return free_port()


def _comm_target(tls: Path, port: int, logs: Path) -> subprocess.Popen[Any]:
    command = [
        *descriptors_capped(HONEST_NOFILE),
        sys.executable,
        "-m",
        "seamline_bench.fuzz_comm_target",
        "--port",
        str(port),
        "--tls-dir",
        str(tls),
    ]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=(logs / "comm.log").open("w"), text=True
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # ready
    return proc


def node_cap_bytes() -> int:
    return int(memory_cap_gb(None, 2, CONTEXT) * (1 << 30))


def attacker(name: str, target: dict[str, Any], logs: Path) -> Driver:
    """The attacker's own process (``attackers``); its log goes to ``logs``."""
    return Driver(
        "seamline_bench.attackers",
        [name, json.dumps(target)],
        stderr=(logs / f"attack-{name}.log").open("a"),
    )


def wait_until(check: Any, timeout_s: float, every_s: float = 0.5) -> Any:
    """``check()`` until it is truthy (its value) or ``timeout_s`` has passed (None)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    return None
