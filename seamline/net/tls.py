"""TLS 1.3 over a blocking socket, for one reader and several writers at once.

OpenSSL's connection object must not be read on one thread while another writes on it, and a
Link (or a lockstep comm's large send) does exactly that. So the TLS state here is an
``ssl.SSLObject`` over two memory buffers: encrypting and decrypting run under a short lock,
the socket's reads and writes outside it. ``TlsSocket`` offers the calls ``Link`` and
``TcpComm`` make on a socket, so either runs over TLS unchanged.

Both sides present a certificate from the mesh's CA (``seamline.mesh.identity`` makes the
contexts); ``peer_id`` is the node id the peer's certificate names.

A deadline here is total (``net.deadlines``): the handshake, a send, a read each end by one,
however slowly the peer drips or drains bytes.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from seamline.net.deadlines import Buffer, send_by, wait

RECV_CHUNK = 256 << 10
ONE_RECORD = (
    16 << 10
)  # TLS's largest record: buffers up to this are sealed together, not one record each
FLUSH_S = 30.0  # a reader's answer to the peer's TLS message (a key update) leaves within this


@dataclass(frozen=True)
class GroupTls:
    """Mutual TLS for a lockstep group: this rank's contexts, and the node id each rank's
    certificate must name, in rank order."""

    server: ssl.SSLContext
    client: ssl.SSLContext
    names: tuple[str, ...]


def mutual_context(
    server_side: bool,
    cert_file: str | Path,
    key_file: str | Path,
    ca_pem: str,
    require_peer: bool = True,
) -> ssl.SSLContext:
    """A TLS 1.3 context that presents this certificate and verifies the peer's against the CA
    (``require_peer`` False: a server that lets a peer without one in). Members are reached by
    address, not host name: the caller checks the peer's node id (``TlsSocket.peer_id``)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    if server_side:
        context.num_tickets = 0  # no resumption: a read never has to write
    else:
        context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED if require_peer else ssl.CERT_OPTIONAL
    context.load_verify_locations(cadata=ca_pem)
    context.load_cert_chain(cert_file, key_file)
    return context


def group_tls_from_folder(folder: Path, rank: int, world: int) -> GroupTls:
    """A lockstep rank's GroupTls from files: ``ca.pem``, ``rank{R}.pem`` and ``rank{R}.key``;
    rank R's certificate names ``rank{R}`` (a group started by hand or by a benchmark)."""
    cert, key, ca = (
        folder / f"rank{rank}.pem",
        folder / f"rank{rank}.key",
        (folder / "ca.pem").read_text(),
    )
    names = tuple(f"rank{r}" for r in range(world))
    return GroupTls(
        mutual_context(True, cert, key, ca), mutual_context(False, cert, key, ca), names
    )


class TlsRefused(ConnectionError):
    """The TLS handshake failed: a plaintext peer, a certificate from another CA, an expired one."""


class TlsSocket:
    """A connected socket after a TLS handshake; see the module doc for why not ``SSLSocket``."""

    def __init__(
        self,
        sock: socket.socket,
        tls: ssl.SSLObject,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
    ) -> None:
        self._sock = sock
        self._tls = tls
        self._incoming = incoming
        self._outgoing = outgoing
        self._tls_lock = threading.Lock()  # the SSLObject: held only for in-memory work
        self._send_lock = threading.Lock()  # keeps one sender's records together on the wire

    @classmethod
    def handshake(
        cls, sock: socket.socket, context: ssl.SSLContext, server_side: bool, deadline_s: float
    ) -> TlsSocket:
        """Run the whole handshake within ``deadline_s`` (not per read: a peer dripping its
        hello is cut off at the deadline); TlsRefused says why it failed."""
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = context.wrap_bio(incoming, outgoing, server_side=server_side)
        end = time.monotonic() + deadline_s
        try:
            while True:
                try:
                    tls.do_handshake()
                    done = True
                except ssl.SSLWantReadError:
                    done = False
                if outgoing.pending:
                    send_by(sock, [outgoing.read()], end)
                if done:
                    break
                wait(sock, False, end)
                data = sock.recv(RECV_CHUNK)
                if not data:
                    raise TlsRefused("the peer closed the connection during the TLS handshake")
                incoming.write(data)
        except ssl.SSLError as exc:
            _send_alert(sock, outgoing)
            raise TlsRefused(
                f"TLS handshake failed: {getattr(exc, 'verify_message', None) or exc.reason or exc}"
            ) from None
        except TimeoutError:
            raise TlsRefused(f"no TLS handshake within {deadline_s} s") from None
        except OSError as exc:
            raise TlsRefused(f"the link broke during the TLS handshake: {exc}") from None
        return cls(sock, tls, incoming, outgoing)

    # -- the socket calls Link and TcpComm make --------------------------------------------
    def sendmsg(
        self,
        buffers: Iterable[Buffer],
        deadline: float | None = None,
        took: Callable[[], None] | None = None,
    ) -> int:
        """Seal and send every buffer; by ``deadline`` (TimeoutError after: the stream is cut)
        or, with None, as the socket's timeout says. ``took``: see ``deadlines.send_by``."""
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(v.nbytes for v in views)
        if 1 < len(views) and total <= ONE_RECORD:  # a frame's header and payload as one record
            views = [memoryview(b"".join(views))]
        with self._send_lock:
            with self._tls_lock:
                for view in views:
                    if view.nbytes:
                        self._tls.write(view)
                sealed = self._outgoing.read()
            if deadline is None:
                self._sock.sendall(sealed)
            else:
                send_by(self._sock, [sealed], deadline, took)
        return total

    def sendall(self, data: Buffer) -> None:
        self.sendmsg([data])

    def recv_into(self, view: memoryview, nbytes: int = 0, deadline: float | None = None) -> int:
        """Up to ``nbytes`` (default: the view's size) decrypted bytes; 0 when the peer closed;
        TimeoutError when none has come by ``deadline`` (None: wait as the socket does)."""
        size = nbytes or len(view)
        while True:
            got: int | None = None
            with self._tls_lock:
                if (
                    self._incoming.pending or self._tls.pending()
                ):  # else a read could only want more
                    try:
                        got = self._tls.read(size, view)
                    except ssl.SSLWantReadError:
                        pass
                    except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                        return 0
                    answer = self._outgoing.pending  # TLS may answer a peer's message on a read
                else:
                    answer = 0
            if answer:
                self._flush()
            if got is not None:
                return got
            if deadline is not None:
                wait(self._sock, False, deadline)
            data = self._sock.recv(RECV_CHUNK)
            if not data:
                return 0
            with self._tls_lock:
                self._incoming.write(data)

    def _flush(self) -> None:
        with self._send_lock:
            with self._tls_lock:
                sealed = self._outgoing.read()
            send_by(
                self._sock, [sealed], time.monotonic() + FLUSH_S
            )  # a reader never blocks for good

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._sock.gettimeout()

    def getpeername(self) -> tuple:
        return self._sock.getpeername()

    def getsockname(self) -> tuple:
        return self._sock.getsockname()

    def setsockopt(self, *args: object) -> None:
        self._sock.setsockopt(*args)  # type: ignore[arg-type]

    def fileno(self) -> int:
        return self._sock.fileno()

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> TlsSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- identity -----------------------------------------------------------------------
    def peer_id(self) -> str:
        """The common name of the peer's verified certificate (its node id); "" if none."""
        return certificate_name(self._tls.getpeercert() or {})

    def peer_certificate_der(self) -> bytes | None:
        return self._tls.getpeercert(binary_form=True)


def _send_alert(sock: socket.socket, outgoing: ssl.MemoryBIO) -> None:
    """Tell the peer why (OpenSSL left an alert to send), so it fails at once, not at a timeout."""
    try:
        if outgoing.pending:
            send_by(
                sock, [outgoing.read()], time.monotonic() + 1.0
            )  # a peer that reads nothing gets none
    except OSError:
        pass


def send_within(
    sock: socket.socket | TlsSocket,
    buffers: Sequence[Buffer],
    deadline: float,
    took: Callable[[], None] | None = None,
) -> None:
    """Send ``buffers`` on a plain or a TLS socket by ``deadline``; TimeoutError after (the
    stream is then cut mid-frame: close it). ``took``: see ``deadlines.send_by``."""
    if isinstance(sock, TlsSocket):
        sock.sendmsg(buffers, deadline, took)
    else:
        send_by(sock, buffers, deadline, took)


def recv_within(sock: socket.socket | TlsSocket, view: memoryview, deadline: float | None) -> int:
    """Up to ``len(view)`` bytes from a plain or a TLS socket (0: the peer closed); TimeoutError
    when none has come by ``deadline`` (None: wait as the socket does)."""
    if isinstance(sock, TlsSocket):
        return sock.recv_into(view, len(view), deadline)
    if deadline is not None:
        wait(sock, False, deadline)
    return sock.recv_into(view)


def certificate_name(certificate: dict) -> str:
    for rdn in certificate.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""
