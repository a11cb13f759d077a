"""Link: one framed, full-duplex connection (connect, send frame, receive frame, close).

Blocking sockets with TCP_NODELAY (the fastest option measured on these machines, see
NETWORK.md); header and payload leave in one ``sendmsg``. Sends are serialised by a lock so
several threads may share a link; one thread receives. Over TLS (``tls.TlsSocket``) the same
calls run on the decrypted stream.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Union

import torch

from seamline.net.frames import (
    HANDSHAKE_DEADLINE_S,
    HANDSHAKE_LIMITS,
    HEADER,
    LIMITS,
    FrameError,
    FrameType,
    HiddenFrame,
    Row,
    TokenFrame,
    TokenRow,
    decode_hidden,
    decode_tokens,
    encode_hidden,
    encode_tokens,
    parse_header,
)
from seamline.net.messages import Message, decode_message, encode_message
from seamline.net.tls import TlsRefused, TlsSocket

log = logging.getLogger("seamline.link")

Incoming = Union[Message, HiddenFrame, TokenFrame]


class LinkClosed(Exception):
    """The peer closed the connection (or it broke)."""


def tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:  # bbr adds milliseconds to small messages at LAN RTTs; cubic does not
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"cubic")
    except OSError:
        pass
    return sock


class Link:
    def __init__(self, sock: socket.socket | TlsSocket, name: str = "") -> None:
        self.sock = sock
        self.name = name
        self._send_lock = threading.Lock()
        self.closed = False
        self.bytes_sent = 0  # frame bytes sent so far (headers included)
        self.limits = LIMITS  # frame sizes taken; HANDSHAKE_LIMITS until the peer is authenticated

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = 10.0, name: str = "",
                tls: ssl.SSLContext | None = None, preamble: bytes = b"") -> "Link":  # fmt: skip
        """Dial ``host:port``, send ``preamble`` (a relay's ticket), and with ``tls`` run the TLS
        handshake (TlsRefused if it fails)."""
        sock = tune(socket.create_connection((host, port), timeout=timeout))
        try:
            if preamble:
                sock.sendall(preamble)
            secured = TlsSocket.handshake(sock, tls, False, timeout) if tls is not None else sock
        except TlsRefused:
            sock.close()
            raise
        secured.settimeout(None)
        return cls(secured, name or f"{host}:{port}")

    def peer_id(self) -> str:
        """The node id in the peer's verified certificate ("" on a plaintext link)."""
        return self.sock.peer_id() if isinstance(self.sock, TlsSocket) else ""

    def peer(self) -> str:
        try:
            host, port = self.sock.getpeername()[:2]
            return f"{host}:{port}"
        except OSError:
            return self.name

    def send_message(self, message: Message) -> None:
        self._send([encode_message(message)])

    def send_hidden(self, rows: list[Row], tensor: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        self._send(encode_hidden(rows, tensor, ids))

    def send_tokens(self, rows: list[TokenRow]) -> None:
        self._send([encode_tokens(rows)])

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are (tests use this to send malformed frames)."""
        self._send([data])

    def _send(self, buffers: list[bytes | memoryview]) -> None:
        total = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in buffers)
        try:
            with self._send_lock:
                sent = self.sock.sendmsg(buffers)
                if sent < total:  # rare: the kernel took part of it; send the rest plainly
                    self.sock.sendall(b"".join(bytes(b) for b in buffers)[sent:])
                self.bytes_sent += total
        except OSError as exc:
            self.closed = True
            raise LinkClosed(f"link to {self.name} broke: {exc}") from None

    def recv(self, deadline_s: float | None = None) -> Incoming:
        """The next frame, decoded and validated; FrameError on anything malformed or larger
        than ``self.limits``; LinkClosed when a whole frame has not come within ``deadline_s``."""
        if deadline_s is not None:
            self.sock.settimeout(deadline_s)
        try:
            frame_type, length = parse_header(bytes(self._read(HEADER.size)), self.limits)
            payload = self._read(length)
        finally:
            if deadline_s is not None and not self.closed:
                self.sock.settimeout(None)
        if frame_type is FrameType.CONTROL:
            return decode_message(payload)
        if frame_type is FrameType.HIDDEN:
            return decode_hidden(payload)
        return decode_tokens(payload)

    def _read(self, size: int) -> bytearray:
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            try:
                n = self.sock.recv_into(view[got:], size - got)
            except TimeoutError:
                raise LinkClosed(f"{self.name} sent no whole frame in time") from None
            except OSError as exc:
                raise LinkClosed(f"link to {self.name} broke: {exc}") from None
            if n == 0:
                raise LinkClosed(f"link to {self.name} closed by peer")
            got += n
        return buf

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


TlsSource = Callable[[], ssl.SSLContext | None]  # the context to accept with now (certificates renew)
MAX_LINKS_PER_HOST = 64  # connections one address may hold open on one port: its links, handshakes, strays
REFUSAL_LOG_S = 10.0  # at most one line per port this often about connections over that bound


class _HostCount:
    """Connections open per peer address on one port; a connection over the bound is closed
    at once, before it costs a thread."""

    def __init__(self, name: str, bound: int) -> None:
        self.name, self.bound = name, bound
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()
        self._refused, self._logged = 0, 0.0

    def admit(self, host: str) -> bool:
        with self._lock:
            if self._open.get(host, 0) >= self.bound:
                self._refused += 1
                now = time.monotonic()
                if now - self._logged >= REFUSAL_LOG_S:
                    log.warning("refused %d %s connection(s) from %s: it holds %d open already",
                                self._refused, self.name, host, self.bound)  # fmt: skip
                    self._refused, self._logged = 0, now
                return False
            self._open[host] = self._open.get(host, 0) + 1
            return True

    def release(self, host: str) -> None:
        with self._lock:
            left = self._open.get(host, 1) - 1
            if left:
                self._open[host] = left
            else:
                self._open.pop(host, None)


def _took_plain(sock: socket.socket, address: tuple, plain: dict[bytes, PlainHandler]) -> bool:
    """Whether the connection opened with a magic in ``plain``, whose handler then took it."""
    sock.settimeout(HANDSHAKE_DEADLINE_S)
    try:
        opening = sock.recv(4, socket.MSG_PEEK | socket.MSG_WAITALL)
    except OSError:
        opening = b""
    sock.settimeout(None)
    handler = plain.get(opening)
    if handler is None:
        return False
    sock.recv(4)
    handler(sock, address)
    return True


PlainHandler = Callable[[socket.socket, tuple], None]  # a connection that opened with a magic (read already)


def accept_links(server: socket.socket, name: str, handle: Callable[[Link], None],
                 tls: TlsSource = lambda: None, per_host: int = MAX_LINKS_PER_HOST,
                 plain: dict[bytes, PlainHandler] | None = None) -> threading.Thread:  # fmt: skip
    """Accept connections until ``server`` closes; each becomes a Link handled on its own
    thread, after a TLS handshake when ``tls`` gives a context (a failed one is logged). One
    address holds at most ``per_host`` connections here at once. Over TLS, a connection that
    opens with one of ``plain``'s 4-byte magics goes to its handler instead (a relay, a probe)."""
    count = _HostCount(name, per_host)

    def open_link(sock: socket.socket, address: tuple) -> None:
        try:
            context = tls()
            # a TLS client speaks first, so a peek cannot stall it; in plaintext the server does
            if plain and context is not None and _took_plain(sock, address, plain):
                return
            if context is not None:
                try:
                    sock = TlsSocket.handshake(sock, context, True, HANDSHAKE_DEADLINE_S)  # type: ignore[assignment]
                except TlsRefused as exc:
                    log.warning("refused %s link from %s:%s: %s", name, address[0], address[1], exc)
                    sock.close()
                    return
            handle(Link(sock, name=name))
        finally:
            count.release(address[0])

    def loop() -> None:
        while True:
            try:
                sock, address = server.accept()
            except OSError:
                return
            if not count.admit(address[0]):
                sock.close()
                continue
            threading.Thread(target=open_link, args=(tune(sock), address), daemon=True).start()

    thread = threading.Thread(target=loop, name=f"seamline-accept-{name}", daemon=True)
    thread.start()
    return thread


def listen(host: str, port: int) -> socket.socket:
    server = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, port))
    server.listen(64)
    return server


__all__ = ["Link", "LinkClosed", "FrameError", "listen", "Incoming", "HANDSHAKE_LIMITS"]


def free_port(host: str = "127.0.0.1", low: int = 20000, high: int = 30000) -> int:
    """A port that is free now, outside the ephemeral range (where a dial can self-connect)."""
    import random

    for port in random.sample(range(low, high), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {low}-{high} on {host}")
