"""Strangers' connections that never begin a handshake, held open by the thousand, at the ports
that take TLS after the accept: a coordinator's and a node's fragment port (each in a process of
512 descriptors) and a lockstep rank's comm port. Each port cuts them at its bounds from the
accept on, the process keeps its descriptors for everything else, /health is answered
throughout, and a group forms at once."""

from __future__ import annotations

import resource
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from seamline.mesh.identity import MeshAuthority
from seamline.net.link import free_port
from seamline.net.tls import GroupTls
from seamline.parallel import GateTag
from seamline.parallel.tcp_comm import TcpComm
from seamline.server.demo import memory_cap_gb
from tests.support.mesh_harness import MeshProcesses

HTTPS_API = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))
from fastapi import FastAPI
from seamline.net.http_guard import serve_once_listening
app = FastAPI()
app.get("/health")(lambda: {"ok": True})
port, cert, key = sys.argv[1:]
ready = lambda: print("listening", flush=True)
serve_once_listening(
    app, ready, "127.0.0.1", int(port), log_level="warning", ssl_certfile=cert, ssl_keyfile=key
)
"""

NOFILE = 512  # each honest process's descriptors, hard limit too
FLOOD = 1500  # connections the stranger opens: three times as many
STRANGER = "127.0.0.66"  # a loopback address of the stranger's own
CAPPED = ("prlimit", f"--nofile={NOFILE}:{NOFILE}", "--")


@pytest.fixture(scope="module")
def mesh(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[MeshProcesses, psutil.Process]]:
    """A coordinator waiting for two nodes and the one that joined: nothing is planned or
    loaded, and both serve their fragments."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    mesh = MeshProcesses(
        tmp_path_factory.mktemp("floods"),
        nodes=2,
        node_memory_gb=memory_cap_gb(None, 2, 1024),
        serve_args=("--context", "1024"),
        prefix=CAPPED,
    )
    mesh.start(join=False)
    node = psutil.Process(mesh.join("node0", prefix=CAPPED).pid)
    try:
        deadline = time.monotonic() + 120
        while not _joined(mesh):
            assert time.monotonic() < deadline, mesh.status_or_output()
            time.sleep(0.5)
        yield mesh, node
    finally:
        mesh.stop()


def _joined(mesh: MeshProcesses) -> bool:
    try:
        return any(n["node_id"] == "node0" for n in mesh.status().get("nodes", []))
    except (httpx.HTTPError, ValueError):
        return False


def _fragment_port(mesh: MeshProcesses, node: psutil.Process) -> int:
    """The node's fragment port: the one it listens on besides its data port."""
    data = int(
        next(n for n in mesh.status()["nodes"] if n["node_id"] == "node0")["address"].split(":")[1]
    )
    ports = {c.laddr.port for c in node.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    (port,) = ports - {data}
    return port


class Flood:
    """``FLOOD`` connections to ``port`` from ``STRANGER`` that send nothing, opened as fast as
    they are taken and held until ``close``."""

    def __init__(self, port: int) -> None:
        self.port, self.held = port, list[socket.socket]()
        self._thread = threading.Thread(target=self._open, daemon=True)
        self._thread.start()

    def _open(self) -> None:
        failures = 0
        while len(self.held) < FLOOD and failures < 20:
            try:
                address = ("127.0.0.1", self.port)
                self.held.append(socket.create_connection(address, 0.5, (STRANGER, 0)))
            except OSError:
                failures += 1

    def close(self) -> int:
        """Drop every connection; how many were opened."""
        self._thread.join(30)
        for sock in self.held:
            sock.close()
        return len(self.held)


def _watch(url: str, process: psutil.Process, seconds: float) -> dict[str, object]:
    """/health asked on a new connection twice a second for ``seconds``; the answers that did
    not come within 5 s and the most descriptors ``process`` held."""
    missed: list[str] = []
    most = 0
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        most = max(most, process.num_fds())
        try:
            with httpx.Client(timeout=5, verify=False) as client:
                assert client.get(f"{url}/health").status_code in (200, 503)
        except httpx.HTTPError as exc:
            missed.append(type(exc).__name__)
        time.sleep(0.5)
    return {"missed": missed, "most_fds": most}


def _handshakes(port: int) -> bool:
    """Whether the port runs a TLS handshake with a new client (no certificate asked of the
    server's; TLS 1.3 ends the client's side before the server judges the client's)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection(("127.0.0.1", port), 5) as raw:
            with context.wrap_socket(raw) as tls:
                return tls.version() is not None
    except OSError:
        return False


def test_a_flood_at_the_coordinators_fragment_port_leaves_health_answered(
    mesh: tuple[MeshProcesses, psutil.Process],
) -> None:
    processes, _ = mesh
    coordinator = psutil.Process(processes.serve.pid)  # type: ignore[union-attr]
    flood = Flood(processes.fragments_port)
    seen = _watch(processes.base_url, coordinator, 12)
    took = _handshakes(processes.fragments_port)
    opened = flood.close()
    assert opened > NOFILE, opened
    assert not seen["missed"] and took, seen
    assert int(seen["most_fds"]) < NOFILE * 3 // 4, seen  # the reserve was never touched


def test_a_flood_at_a_nodes_fragment_port_leaves_it_serving(
    mesh: tuple[MeshProcesses, psutil.Process],
) -> None:
    processes, node = mesh
    port = _fragment_port(processes, node)
    flood = Flood(port)
    seen = _watch(processes.base_url, node, 12)
    took = _handshakes(port)
    opened = flood.close()
    assert opened > NOFILE, opened
    assert not seen["missed"] and took, seen
    assert int(seen["most_fds"]) < NOFILE * 3 // 4, seen
    assert node.is_running() and _joined(processes)


def test_a_flood_at_a_comm_port_does_not_hold_up_the_group() -> None:
    """Rank 1 listens; a stranger holds ever more connections to its comm port; rank 0, dialling
    into the flood, is taken at once and the group sums."""
    ca = MeshAuthority.create()
    names = ("node0", "node1")
    addresses = [("127.0.0.1", free_port()), ("127.0.0.1", free_port())]
    formed: dict[int, object] = {}

    def rank(r: int) -> None:
        identity = ca.identity(names[r])
        tls = GroupTls(identity.server_context(), identity.client_context(), names)
        try:
            formed[r] = TcpComm.connect(
                r, 2, addresses, 10.0, "fp", connect_timeout_s=60.0, tls=tls
            )
        except Exception as exc:  # the test reads it
            formed[r] = exc

    one = threading.Thread(target=rank, args=(1,))
    one.start()
    time.sleep(1.0)  # rank 1 listens
    flood = Flood(addresses[1][1])
    time.sleep(2.0)  # the flood is under way
    began = time.monotonic()
    zero = threading.Thread(target=rank, args=(0,))
    zero.start()
    zero.join(60)
    one.join(60)
    took = time.monotonic() - began
    opened = flood.close()
    comms = [formed.get(0), formed.get(1)]
    assert isinstance(comms[0], TcpComm) and isinstance(comms[1], TcpComm), formed
    assert took < 5, took
    assert opened > 200, opened
    summed: dict[int, torch.Tensor] = {}
    summer = threading.Thread(
        target=lambda: summed.update({1: comms[1].all_reduce(torch.ones(4), GateTag(0, 0, 1))})  # type: ignore[union-attr]
    )
    summer.start()
    summed[0] = comms[0].all_reduce(torch.full((4,), 2.0), GateTag(0, 0, 1))
    summer.join(10)
    assert torch.equal(summed[0], torch.full((4,), 3.0)) and torch.equal(summed[1], summed[0])
    for comm in comms:
        comm.close()  # type: ignore[union-attr]


def test_a_flood_at_an_https_api_leaves_health_answered(tmp_path: Path) -> None:
    """The API served over HTTPS takes TLS after the accept too: the same flood, /health asked
    over HTTPS throughout."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
        + [
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", HTTPS_API, str(port), str(cert), str(key)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        flood = Flood(port)
        seen = _watch(f"https://127.0.0.1:{port}", psutil.Process(server.pid), 12)
        opened = flood.close()
        assert opened > NOFILE, opened
        assert not seen["missed"], seen
        assert int(seen["most_fds"]) < NOFILE * 3 // 4, seen
    finally:
        server.kill()
        server.wait(10)
