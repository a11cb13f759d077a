"""Attackers on every listening port of a live mesh (`seamline bench fuzz`'s ``attacks``), moved
here from tests/api/test_net_limits.py:

- ``fd_exhaustion``: as many idle connections to every port as this process may open (its
  descriptor limit raised to the hard limit; honest processes keep theirs), held for
  ``duration_s``, then dropped at once; from a loopback address of its own (``STRANGER``), as a
  stranger's host has one (an attacker that shares the clients' address is cut per address with
  them: tests/api/test_http_guard.py keeps new clients served then, not every keep-alive one);
- ``dripped_handshake``: connections that drip a TLS ClientHello (or, after TLS, a first
  message; or, to the API, an HTTP request head) a byte a second; each should be cut about
  ``HANDSHAKE_DEADLINE_S`` after it opened. A lockstep rank's comm port is dripped at too while
  the bench forms a group with it.
"""

from __future__ import annotations

import resource
import select
import socket
import ssl
import threading
import time
from typing import Any

from seamline.mesh.identity import enrolling_context
from seamline.net.frames import HANDSHAKE_DEADLINE_S
from seamline.net.messages import Ping, encode_message
from seamline.net.tls import TlsRefused, TlsSocket

Address = tuple[str, int]
PER_PORT = 1500  # more than an honest process's 1024 descriptors
STRANGER = "127.0.0.66"  # fd_exhaustion's source address: not the clients' or the nodes' 127.0.0.1
HTTP_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" * 4
)


def ports(target: dict[str, Any]) -> dict[str, Address]:
    """Every listening port of the mesh's honest processes, by name."""
    api = target["api"].removeprefix("http://").rsplit(":", 1)
    out = {
        "api": (api[0], int(api[1])),
        "control": tuple(target["control"]),
        "coordinator_fragments": tuple(target["fragments"]),
    }
    for node in target["nodes"]:
        out[f"{node['node_id']}:data"] = tuple(node["data"])
        for port in node["other_ports"]:
            out[f"{node['node_id']}:{port}"] = ("127.0.0.1", int(port))
    if target.get("comm"):
        out["comm"] = tuple(target["comm"])
    return out  # type: ignore[return-value]


# -- fd_exhaustion --------------------------------------------------------------------------------
def fd_exhaustion(target: dict[str, Any], duration_s: float) -> dict[str, Any]:
    """Idle connections to every port, ``PER_PORT`` at most each, opened within half the attack;
    held to its end, then dropped at once."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    began = time.monotonic()
    held: list[socket.socket] = []
    opened: dict[str, int] = {}
    named = ports(target)
    for index, (name, address) in enumerate(named.items()):
        until = began + duration_s / 2 * (index + 1) / len(named)  # each port its share of the time
        opened[name] = _flood(address, held, min(PER_PORT, hard - len(held) - 64), until)
    filled_s = time.monotonic() - began
    time.sleep(max(0.0, duration_s - filled_s))
    closed_by_server = _closed_count(held)
    for sock in held:
        sock.close()
    return {
        "connections_opened": opened,
        "held": len(held),
        "closed_by_the_mesh_while_held": closed_by_server,
        "seconds_to_open": round(filled_s, 1),
        "nofile_limit": hard,
    }


def _flood(address: Address, held: list[socket.socket], most: int, until: float) -> int:
    count = failures = 0
    while count < most and failures < 5 and time.monotonic() < until:
        try:
            held.append(
                socket.create_connection(address, timeout=0.2, source_address=(STRANGER, 0))
            )
            count += 1
        except OSError:
            failures += 1
    return count


def _closed_count(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the peer has closed (readable, and reading gives nothing)."""
    poller = select.poll()
    by_fd = {sock.fileno(): sock for sock in socks}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    return sum(_closed(by_fd[fd]) for fd, _ in poller.poll(0))


def _closed(sock: socket.socket) -> bool:
    """Whether the peer has closed ``sock`` (call when it is readable, or checked as ``_readable``)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _readable_and_closed(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0]) and _closed(sock)


# -- dripped_handshake ----------------------------------------------------------------------------
def dripped_handshake(
    target: dict[str, Any], duration_s: float, per_port: int = 4
) -> dict[str, Any]:
    """``per_port`` drips at every port (a ClientHello; to the API an HTTP head; to the control
    port also a first message after TLS): when each was cut, in seconds after it opened."""
    cuts: dict[str, list[float]] = {}
    threads = []
    for name, address in ports(target).items():
        kinds = (
            ["http"] if name == "api" else ["hello", "message"] if name == "control" else ["hello"]
        )
        for kind in kinds:
            key = f"{name}:{kind}"
            cuts[key] = []
            for _ in range(per_port):
                thread = threading.Thread(
                    target=_drip_one, args=(address, kind, duration_s, cuts[key]), daemon=True
                )
                thread.start()
                threads.append(thread)
    for thread in threads:
        thread.join(duration_s + 15)
    limit = HANDSHAKE_DEADLINE_S + 3
    summary = {
        key: {"cut": len(after), "latest_cut_s": round(max(after), 1) if after else None}
        for key, after in cuts.items()
    }
    ours = [
        key for key in cuts if key.split(":")[0] in ("control", "comm") or ":data:" in key
    ]  # the mesh's own accept loops
    in_time = all(len(cuts[k]) == per_port and max(cuts[k]) < limit for k in ours)
    return {
        "connections_per_port": per_port,
        "cut": summary,
        "deadline_s": HANDSHAKE_DEADLINE_S,
        "refused": in_time,
        "checked": ours,
        "not_cut_within_the_attack": [k for k, after in cuts.items() if len(after) < per_port],
    }


def _drip_one(address: Address, kind: str, duration_s: float, cut: list[float]) -> None:
    opened = time.monotonic()
    try:
        sock = socket.create_connection(address, timeout=5)
    except OSError:
        return
    try:
        send: Any = sock.sendall
        data = HTTP_HEAD if kind == "http" else _client_hello()
        if (
            kind == "message"
        ):  # TLS done (no certificate, as a joining node), then its first message dripped
            channel = TlsSocket.handshake(sock, enrolling_context(), False, 5)
            send, data = channel.sendall, encode_message(Ping(nonce=1, pad="x" * 200))
        _drip(sock, data, send, opened, duration_s, cut)
    except (OSError, TlsRefused, ssl.SSLError):
        cut.append(time.monotonic() - opened)
    finally:
        sock.close()


def _drip(
    sock: socket.socket, data: bytes, send: Any, opened: float, duration_s: float, cut: list[float]
) -> None:
    """Send ``data`` a byte a second until the listener closes ``sock`` (recording when) or
    ``duration_s`` has passed."""
    for byte in data:
        for _ in range(10):
            if _readable_and_closed(sock):
                cut.append(time.monotonic() - opened)
                return
            time.sleep(0.1)
        if time.monotonic() - opened > duration_s:
            return
        try:
            send(bytes([byte]))
        except OSError:
            cut.append(time.monotonic() - opened)
            return


def _client_hello() -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).wrap_bio(incoming, outgoing, server_side=False)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()
