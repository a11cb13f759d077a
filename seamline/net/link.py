"""Link: one framed, full-duplex connection (connect, send frame, receive frame, close).

Blocking sockets with TCP_NODELAY (the fastest option measured on these machines, see
NETWORK.md); header and payload leave in one ``sendmsg``. Sends are serialised by a lock so
several threads may share a link; one thread receives. Over TLS (``tls.TlsSocket``) the same
calls run on the decrypted stream.

Every send has a deadline (``net.deadlines``; the socket's timeout stays unset, as it would
apply to the reader too): a peer that stops reading is cut off, the link closed, instead of
holding its sender for good. A read waits as long as it must unless a deadline is asked for.
Accepted links count against their port's bounds on unproved peers (``net.admission``) until
their handler calls ``authenticated``.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence

import torch

from seamline.net.admission import MAX_PENDING, MAX_PENDING_PER_HOST, Admission, Pending
from seamline.net.deadlines import left, wait
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
from seamline.net.tls import TlsRefused, TlsSocket, recv_within, send_within

log = logging.getLogger("seamline.link")

Incoming = Message | HiddenFrame | TokenFrame
SEND_DEADLINE_S = (
    30.0  # a frame the peer has not taken by then (plus the time its size takes) cuts the link
)
SLOWEST_BYTES_PER_S = 1 << 20  # the slowest link a large frame must still cross within its deadline


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
    def __init__(
        self, sock: socket.socket | TlsSocket, name: str = "", pending: Pending | None = None
    ) -> None:
        """``pending``: an accepted peer not yet proved (``accept_links``): it is held to the
        port's bounds and its handshake deadline until ``authenticated``."""
        sock.settimeout(None)  # blocking: deadlines are kept by polling (``net.deadlines``)
        self.sock = sock
        self.name = name
        self._send_lock = threading.Lock()
        self._taken_at: float | None = (
            None  # when the send under way began, or the kernel last took bytes of it
        )
        self._pending = pending
        self.closed = False
        self.bytes_sent = 0  # frame bytes sent so far (headers included)
        self._limits = HANDSHAKE_LIMITS if pending is not None else LIMITS

    @property
    def limits(self) -> dict[FrameType, int]:
        """Frame sizes taken; HANDSHAKE_LIMITS until the peer is authenticated."""
        return self._limits

    @limits.setter
    def limits(self, value: dict[FrameType, int]) -> None:
        self._limits = value
        if (
            value != HANDSHAKE_LIMITS
        ):  # more than a handshake's frames go to a proved peer only: granting them says so
            self.authenticated()

    def authenticated(self) -> None:
        """The handler has proved the peer: the link no longer counts against its port's bounds
        on unproved connections, and the handshake's deadline is lifted."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.proved()

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        timeout: float = 10.0,
        name: str = "",
        tls: ssl.SSLContext | None = None,
        preamble: bytes = b"",
    ) -> Link:
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

    def send_hidden(
        self,
        rows: list[Row],
        tensor: torch.Tensor,
        ids: torch.Tensor | None = None,
        signed: tuple[bytes, bytes] | None = None,
    ) -> None:
        self._send(encode_hidden(rows, tensor, ids, signed))

    def send_tokens(self, rows: list[TokenRow]) -> None:
        self._send([encode_tokens(rows)])

    def send_buffers(self, buffers: Sequence[bytes | memoryview]) -> None:
        """Send one encoded frame's buffers (``frames.encode_*``), header included."""
        self._send(list(buffers))

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are (tests use this to send malformed frames)."""
        self._send([data])

    def try_send_message(self, message: Message, within_s: float) -> bool:
        """Send ``message`` unless another send is under way or the socket has no room now
        (False: not sent). A heartbeat goes this way, so it never waits behind another sender
        or a peer that reads nothing; sent, it must leave within ``within_s``."""
        if not self._send_lock.acquire(blocking=False):
            return False
        try:
            try:
                wait(self.sock, True, time.monotonic())  # type: ignore[arg-type]  # room now, or not at all
            except TimeoutError:
                return False
            except OSError as exc:
                self._broke(exc)
            data = encode_message(message)
            self._send_locked([data], len(data), time.monotonic() + within_s)
        finally:
            self._send_lock.release()
        return True

    def stalled_for(self) -> float:
        """Seconds since the send under way last got bytes out (0 when none is under way): a
        peer that stopped reading stalls it until its deadline."""
        since = self._taken_at
        return 0.0 if since is None else time.monotonic() - since

    def _took(self) -> None:
        self._taken_at = time.monotonic()

    def _send(self, buffers: list[bytes | memoryview]) -> None:
        total = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in buffers)
        deadline = time.monotonic() + SEND_DEADLINE_S + total / SLOWEST_BYTES_PER_S
        pending = self._pending
        if pending is not None:  # an unproved peer gets nothing past its handshake's deadline
            deadline = min(deadline, pending.deadline)
        with self._send_lock:
            self._send_locked(buffers, total, deadline)

    def _send_locked(self, buffers: list[bytes | memoryview], total: int, deadline: float) -> None:
        """Send under the send lock by ``deadline``; a send that fails or times out closes the
        link (the stream may have stopped mid-frame)."""
        began = self._taken_at = time.monotonic()
        try:
            send_within(self.sock, buffers, deadline, self._took)
        except TimeoutError:
            self._broke(
                f"a frame of {total} bytes did not leave in {time.monotonic() - began:.1f} s"
            )
        except OSError as exc:
            self._broke(exc)
        finally:
            self._taken_at = None
        self.bytes_sent += total

    def _broke(self, why: object) -> None:
        self.close()
        raise LinkClosed(f"link to {self.name} broke: {why}") from None

    def recv(self, deadline_s: float | None = None) -> Incoming:
        """The next frame, decoded and validated; FrameError on anything malformed or larger
        than ``self.limits``; LinkClosed when a whole frame has not come within ``deadline_s``
        (in all, however slowly its bytes drip) or, from an unproved peer, by the end of its
        handshake's deadline."""
        deadline = math.inf if deadline_s is None else time.monotonic() + deadline_s
        pending = self._pending
        if pending is not None:
            deadline = min(deadline, pending.deadline)
        until = None if deadline == math.inf else deadline
        frame_type, length = parse_header(bytes(self._read(HEADER.size, until)), self.limits)
        payload = self._read(length, until)
        if frame_type is FrameType.CONTROL:
            return decode_message(payload)
        if frame_type is FrameType.HIDDEN:
            return decode_hidden(payload)
        return decode_tokens(payload)

    def _read(self, size: int, deadline: float | None = None) -> bytearray:
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            try:
                n = recv_within(self.sock, view[got:], deadline)
            except TimeoutError:
                if deadline is None:
                    continue  # a socket timeout someone else set: no deadline was asked for here
                raise LinkClosed(f"{self.name} sent no whole frame in time") from None
            except OSError as exc:
                raise LinkClosed(f"link to {self.name} broke: {exc}") from None
            if n == 0:
                raise LinkClosed(f"link to {self.name} closed by peer")
            got += n
        return buf

    def discard(self, size: int) -> None:
        """Read and drop ``size`` bytes (an oversized frame's payload from a peer trusted to stay
        in step), a MiB at a time: nothing of that size is allocated."""
        while size > 0:
            step = min(size, 1 << 20)
            self._read(step)
            size -= step

    def __enter__(self) -> Link:
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


TlsSource = Callable[
    [], ssl.SSLContext | None
]  # the context to accept with now (certificates renew)
PlainHandler = Callable[
    [socket.socket, tuple], None
]  # a connection that opened with a magic (read already)
ACCEPT_PAUSE_S = (
    0.05,
    1.0,
)  # a failing accept (no descriptor, memory, buffer) is retried after a pause: first, most
GONE = (
    errno.EBADF,
    errno.EINVAL,
    errno.ENOTSOCK,
)  # what accept says once its socket is closed (or shut)


def _took_plain(
    sock: socket.socket, address: tuple, plain: dict[bytes, PlainHandler], deadline: float
) -> bool:
    """Whether the connection opened with a magic in ``plain``, whose handler then took it. A
    TLS client speaks first, so this waits (until ``deadline``) only while the bytes so far
    could still begin a magic."""
    opening, nap = b"", 0.01
    try:
        while len(opening) < 4:
            wait(sock, False, deadline)
            opening = sock.recv(4, socket.MSG_PEEK)
            if (
                not opening
                or not any(magic.startswith(opening) for magic in plain)
                or time.monotonic() > deadline
            ):
                return False
            if len(opening) < 4:
                time.sleep(nap)  # the rest of a split magic is on its way
                nap = min(0.5, nap * 2)
    except OSError:  # the deadline passed, or the peer left: the TLS handshake says so
        return False
    handler = plain.get(opening)
    if handler is None:
        return False
    sock.recv(4)
    handler(sock, address)
    return True


def accept_links(
    server: socket.socket,
    name: str,
    handle: Callable[[Link], None],
    tls: TlsSource = lambda: None,
    per_host: int = MAX_PENDING_PER_HOST,
    plain: dict[bytes, PlainHandler] | None = None,
    pending_max: int = MAX_PENDING,
) -> threading.Thread:
    """Accept connections until ``server`` closes; each becomes a Link handled on its own
    thread, after a TLS handshake when ``tls`` gives a context. Over TLS, a connection that
    opens with one of ``plain``'s 4-byte magics goes to its handler instead (a relay, a probe).

    Until its handler calls ``Link.authenticated`` (or returns), a connection is unproved: one
    address holds at most ``per_host`` such here, all together at most ``pending_max`` (so at
    most that many handshake threads; a new one over a bound cuts the oldest), and its whole
    handshake, TLS and first messages, must end within ``HANDSHAKE_DEADLINE_S``
    (``net.admission``). Proved links hold a thread each for as long as they last: bounded by
    the members (control port) and the plan's links and probes (data port), not by strangers."""
    admission = Admission(name, HANDSHAKE_DEADLINE_S, per_host, pending_max)

    def open_link(sock: socket.socket, address: tuple, pending: Pending) -> None:
        try:
            context = tls()
            # a TLS client speaks first, so a peek cannot stall it; in plaintext the server does
            if (
                plain
                and context is not None
                and _took_plain(sock, address, plain, pending.deadline)
            ):
                return
            if context is not None:
                try:
                    sock = TlsSocket.handshake(sock, context, True, left(pending.deadline))  # type: ignore[assignment]
                except TlsRefused as exc:
                    admission.refused(f"{address[0]}:{address[1]}", str(exc))
                    sock.close()
                    return
            handle(Link(sock, name=name, pending=pending))
        finally:
            admission.release(pending)

    def start(sock: socket.socket, address: tuple) -> None:
        pending = admission.admit(sock, address[0])
        try:
            threading.Thread(
                target=open_link, args=(tune(sock), address, pending), daemon=True
            ).start()
        except BaseException:
            admission.release(pending)
            sock.close()
            raise

    thread = threading.Thread(
        target=_accept_forever,
        args=(server, name, start),
        name=f"seamline-accept-{name}",
        daemon=True,
    )
    thread.start()
    return thread


def _accept_forever(
    server: socket.socket, name: str, start: Callable[[socket.socket, tuple], None]
) -> None:
    """Accept until ``server`` is closed. Anything else that fails (no descriptor, memory or
    thread to be had; a connection aborted before it was taken) is waited out, the pause
    doubling, and logged once per episode: a flood that ends leaves the port serving."""
    pause, failures = 0.0, 0
    while True:
        try:
            sock, address = server.accept()
        except OSError as exc:
            if server.fileno() < 0 or exc.errno in GONE:
                return
            failure: Exception | None = exc
        else:
            try:
                start(sock, address)
                failure = None
            except (
                Exception
            ) as exc:  # no thread could start (RuntimeError), no memory: waited out too
                failure = exc
        if failure is not None:
            if not failures:
                log.error("%s port cannot take connections (%s); retrying", name, failure)
            failures += 1
            pause = min(ACCEPT_PAUSE_S[1], max(ACCEPT_PAUSE_S[0], pause * 2))
            time.sleep(pause)
            continue
        if failures:
            log.warning("%s port takes connections again, after %d failed tries", name, failures)
            pause, failures = 0.0, 0


def listen(host: str, port: int) -> socket.socket:
    server = _bound(host, port)
    try:
        server.listen(64)
    except OSError:
        server.close()
        raise
    return server


def _bound(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with SO_REUSEADDR (closed again if the bind fails)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


__all__ = ["Link", "LinkClosed", "FrameError", "listen", "Incoming", "HANDSHAKE_LIMITS"]


_HANDED_OUT: set[tuple[str, int]] = (
    set()
)  # ports this process took: a caller may not have bound them yet
_HANDED_OUT_LOCK = threading.Lock()


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound (not listening) to a port of ``free_port``'s, with SO_REUSEADDR: held for
    a port this process listens on now and then (a lockstep rank's, while its group forms).
    While it is held no other process's ``free_port`` hands the port out, and ``listen`` here
    binds it again beside the reservation (both reuse it, neither listens)."""
    return _on_free_port(host, lambda port: _bound(host, port))


def listen_on_free_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket listening on a port of ``free_port``'s: for a port announced before it is served
    (a fragment server's, in a node's join), which no other process may draw meanwhile."""
    return _on_free_port(host, lambda port: listen(host, port))


def _on_free_port(host: str, bind: Callable[[int], socket.socket]) -> socket.socket:
    for _ in range(20):  # another process may take the port between the probe and this bind
        try:
            return bind(free_port(host))
        except OSError:
            continue
    raise OSError(f"could not bind a free port on {host}")


def free_port(host: str = "127.0.0.1", low: int = 20000, high: int = 30000) -> int:
    """A port that is free now, outside the ephemeral range (where a dial can self-connect),
    and never one this process handed out before (a group's ports, taken together, are distinct)."""
    import random

    for port in random.sample(range(low, high), min(200, high - low)):
        with _HANDED_OUT_LOCK, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            if (host, port) in _HANDED_OUT:
                continue
            try:
                probe.bind((host, port))
            except OSError:
                continue
            _HANDED_OUT.add((host, port))
            return port
    raise OSError(f"no free port in {low}-{high} on {host}")
