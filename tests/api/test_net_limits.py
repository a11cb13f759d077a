"""Bounded resources at every listener, on real sockets: an accept loop outlives running out of
descriptors, a peer dripping its handshake is cut at the deadline in all, strangers' idle
connections neither keep a member out nor cost a thread each, and a stranger dripping a
ClientHello at a rank's comm port does not hold up the group."""

from __future__ import annotations

import select
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from seamline.mesh.identity import Identity, MeshAuthority
from seamline.net.frames import HANDSHAKE_DEADLINE_S, FrameError
from seamline.net.link import Link, LinkClosed, accept_links, free_port, listen, tune
from seamline.net.messages import Challenge, Ping, Pong, encode_message
from seamline.net.tls import GroupTls, TlsSocket
from seamline.parallel import GateTag
from seamline.parallel.tcp_comm import TcpComm

ROOT = Path(__file__).resolve().parents[2]  # the repository

# A listener in a process of its own, allowed 32 descriptors more than it holds when idle.
# Each link answers one Ping with a Pong (proving itself first), then closes.
LISTENER = r"""
import os, resource, sys, threading, logging
logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(message)s")
from seamline.net.link import LinkClosed, accept_links, listen
from seamline.net.messages import Pong

def answer(link):
    try:
        ping = link.recv()
        link.authenticated()
        link.send_message(Pong(nonce=ping.nonce))
    except Exception:
        pass
    link.close()

server = listen("127.0.0.1", 0)
accept_links(server, "test", answer)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 32, hard))
print(server.getsockname()[1], flush=True)
threading.Event().wait()
"""


def _ping(
    address: tuple[str, int],
    nonce: int,
    timeout_s: float = 10.0,
    context: ssl.SSLContext | None = None,
    source: str = "",
) -> Link:
    """A link that has sent a Ping and had its Pong."""
    sock = tune(
        socket.create_connection(
            address, timeout=timeout_s, source_address=(source, 0) if source else None
        )
    )
    link = Link(TlsSocket.handshake(sock, context, False, timeout_s) if context else sock, "client")
    link.send_message(Ping(nonce=nonce))
    answer = link.recv(deadline_s=timeout_s)
    assert isinstance(answer, Pong) and answer.nonce == nonce, answer
    return link


def test_an_accept_loop_outlives_running_out_of_descriptors() -> None:
    """A flood takes every descriptor the listener may open (accept fails with EMFILE); once it
    is released, the same listener answers a legitimate link again, within about a second."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTENER],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    errors: list[str] = []
    try:
        address = ("127.0.0.1", int(proc.stdout.readline()))  # type: ignore[union-attr]
        stderr = proc.stderr
        assert stderr is not None
        threading.Thread(
            target=lambda: errors.extend(iter(stderr.readline, "")), daemon=True
        ).start()
        flood: list[socket.socket] = []
        while len(flood) < 1000:  # until the listener's descriptors and then its backlog are full
            try:
                flood.append(socket.create_connection(address, timeout=0.5))
            except OSError:
                break
        assert 32 < len(flood) < 1000, len(flood)
        for sock in flood:
            sock.close()
        released = time.monotonic()
        _ping(address, 7, timeout_s=15).close()
        served_after_s = time.monotonic() - released
        assert served_after_s < 5, served_after_s
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(5)
    ran_out = [line for line in errors if "Too many open files" in line]
    assert len(ran_out) == 1 and any("takes connections again" in line for line in errors), (
        errors
    )  # once per episode


def _closed(sock: socket.socket) -> bool:
    """Whether the peer has closed ``sock`` (nothing else is waiting to be read on it)."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _drip(sock: socket.socket, data: bytes, send: object, opened: float, cut: list[float]) -> None:
    """Send ``data`` one byte a second through ``send`` until the listener closes ``sock``;
    record how long after ``opened`` that was (nothing if it never does within 25 s)."""
    for byte in data:
        for _ in range(10):
            if _closed(sock):
                cut.append(time.monotonic() - opened)
                return
            time.sleep(0.1)
        if time.monotonic() - opened > 25:
            return
        try:
            send(bytes([byte]))  # type: ignore[operator]
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


def test_a_peer_dripping_its_handshake_is_cut_at_the_deadline_in_all() -> None:
    """One peer drips a TLS ClientHello, another completes TLS and drips its first message, a
    byte a second (each read well within any per-read timeout): the listener closes each
    about HANDSHAKE_DEADLINE_S after it connected, not a deadline per byte."""
    ca = MeshAuthority.create()
    server = listen("127.0.0.1", 0)
    address = ("127.0.0.1", server.getsockname()[1])

    def challenge(
        link: Link,
    ) -> None:  # as the mesh's handlers do: every message within the deadline
        try:
            link.send_message(Challenge(nonce="n"))
            while True:
                link.recv(deadline_s=HANDSHAKE_DEADLINE_S)
        except (LinkClosed, FrameError):
            link.close()

    accept_links(server, "drip", challenge, tls=lambda: ca.identity("listener").server_context())
    cut: dict[str, list[float]] = {"hello": [], "message": []}
    opened = time.monotonic()
    hello = socket.create_connection(address)
    threads = [
        threading.Thread(
            target=_drip, args=(hello, _client_hello(), hello.sendall, opened, cut["hello"])
        )
    ]
    raw = socket.create_connection(address)
    member = TlsSocket.handshake(raw, ca.identity("member").client_context(), False, 5)
    assert isinstance(Link(member).recv(deadline_s=5), Challenge)
    message = encode_message(Ping(nonce=1, pad="x" * 200))
    threads.append(
        threading.Thread(target=_drip, args=(raw, message, member.sendall, opened, cut["message"]))
    )
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for what, after in cut.items():
        assert after and HANDSHAKE_DEADLINE_S - 1 < after[0] < HANDSHAKE_DEADLINE_S + 3, (
            what,
            after,
        )
    hello.close()
    raw.close()
    server.close()


def test_strangers_idle_connections_neither_keep_a_member_out_nor_cost_a_thread_each(
    tmp_path: Path,
) -> None:
    """64 idle connections from each of three addresses (127.0.0.1 among them) hold at most the
    port's 128 handshake threads; then a member opens 70 links from 127.0.0.1, each proved in
    turn: every one is taken and stays served (a proved link no longer counts)."""
    ca = MeshAuthority.create()
    server = listen("127.0.0.1", 0)
    address = ("127.0.0.1", server.getsockname()[1])

    def serve(link: Link) -> None:
        try:
            ping = link.recv(deadline_s=HANDSHAKE_DEADLINE_S)
            link.authenticated()
            while isinstance(ping, Ping):
                link.send_message(Pong(nonce=ping.nonce))
                ping = link.recv()
        except (LinkClosed, FrameError):
            link.close()

    accepting = accept_links(
        server, "crowd", serve, tls=lambda: ca.identity("listener").server_context()
    )
    before = threading.active_count()
    strangers = [
        socket.create_connection(address, source_address=(f"127.0.0.{1 + i // 64}", 0))
        for i in range(192)
    ]
    time.sleep(1.0)
    handshaking = threading.active_count() - before
    assert handshaking <= 128 + 2, handshaking  # the watchdog thread, and one being cut
    context = ca.identity("member").client_context()
    members = [
        _ping(address, i, timeout_s=5, context=context, source="127.0.0.1") for i in range(70)
    ]
    for i, link in enumerate(members):  # every proved link is still served
        link.send_message(Ping(nonce=1000 + i))
        answer = link.recv(deadline_s=5)
        assert isinstance(answer, Pong) and answer.nonce == 1000 + i
    for sock in strangers:
        sock.close()
    for link in members:
        link.close()
    server.shutdown(socket.SHUT_RDWR)  # the one thing that ends an accept loop
    server.close()
    accepting.join(2)
    assert not accepting.is_alive()


def test_a_stranger_dripping_a_client_hello_does_not_hold_up_a_group() -> None:
    """A stranger connects to rank 1's comm port first and drips a ClientHello a byte a second;
    rank 0, dialling after it, is taken at once: the group forms in seconds and sums, and the
    stranger is cut off."""
    ca = MeshAuthority.create()
    names = ("node0", "node1")
    identities: list[Identity] = [ca.identity(name) for name in names]
    addresses = [("127.0.0.1", free_port()), ("127.0.0.1", free_port())]
    formed: dict[int, object] = {}

    def rank(r: int) -> None:
        tls = GroupTls(identities[r].server_context(), identities[r].client_context(), names)
        try:
            formed[r] = TcpComm.connect(
                r, 2, addresses, 10.0, "fp", connect_timeout_s=30.0, tls=tls
            )
        except Exception as exc:  # the test reads it
            formed[r] = exc

    began = time.monotonic()
    one = threading.Thread(target=rank, args=(1,))
    one.start()
    stranger = _dial_when_listening(addresses[1])
    cut: list[float] = []
    dripper = threading.Thread(
        target=_drip, args=(stranger, _client_hello(), stranger.sendall, began, cut)
    )
    dripper.start()
    time.sleep(0.5)
    zero = threading.Thread(target=rank, args=(0,))
    zero.start()
    zero.join(30)
    one.join(30)
    took = time.monotonic() - began
    assert all(isinstance(formed.get(r), TcpComm) for r in (0, 1)), formed
    assert took < 15, took
    sums: dict[int, torch.Tensor] = {}
    comms = [formed[0], formed[1]]
    assert isinstance(comms[0], TcpComm) and isinstance(comms[1], TcpComm)
    summer = threading.Thread(
        target=lambda: sums.update({1: comms[1].all_reduce(torch.ones(4), GateTag(0, 0, 1))})
    )
    summer.start()
    sums[0] = comms[0].all_reduce(torch.full((4,), 2.0), GateTag(0, 0, 1))
    summer.join(10)
    assert torch.equal(sums[0], torch.full((4,), 3.0)) and torch.equal(sums[1], sums[0])
    for comm in comms:
        comm.close()
    dripper.join(15)
    assert cut and cut[0] < 15, cut  # cut off once the group formed, if not at its deadline before
    stranger.close()


def _dial_when_listening(address: tuple[str, int], within_s: float = 10.0) -> socket.socket:
    deadline = time.monotonic() + within_s
    while True:
        try:
            return socket.create_connection(address, timeout=1.0)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
