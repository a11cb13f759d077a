"""Links between nodes that cannot reach each other directly, carried through the coordinator.

The coordinator probes a joining node's data port; a node that takes no inbound connection
(behind NAT or a firewall) is reached through a relay. Both ends of such a link dial out to the
coordinator's control port and open with ``RELAY_MAGIC`` and the same one-time ticket, which
the coordinator gave each over its control link; the coordinator pairs the two connections and
copies bytes between them. The ends then run their usual mutual TLS through the pipe, so the
relay carries ciphertext only and can pose as neither end.

A first end waiting for its partner is one of the relay's unproved connections
(``net.admission``): bounded per address and in all, the oldest cut for a new one, and cut when
its ticket lapses; refusals are logged once per while, naming the peer and the reason.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time

from seamline.mesh.protocol.relay_wire import PAIR_WAIT_S, PROBE_MAGIC, TICKET_CHARS
from seamline.net.admission import Admission, Pending
from seamline.net.deadlines import send_by

log = logging.getLogger("seamline.relay")

PROBE_TIMEOUT_S = 2.0
CHUNK = 256 << 10
RELAY_SEND_S = 60.0  # an end that takes none of a chunk for this long is not reading


def reachable(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a connection to ``host:port`` is taken (a node behind NAT or a firewall: no)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(PROBE_MAGIC)
        return True
    except OSError:
        return False


def read_exactly(sock: socket.socket, size: int, deadline_s: float) -> bytes:
    sock.settimeout(deadline_s)
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed before its preamble ended")
        data += chunk
    sock.settimeout(None)
    return data


class Relay:
    def __init__(self) -> None:
        self._tickets: dict[
            str, tuple[float, bool]
        ] = {}  # ticket -> when it lapses, whether for a probe
        self._waiting: dict[str, tuple[socket.socket, Pending]] = {}
        self._lock = threading.Lock()
        self._admission: Admission | None = None  # the first ends waiting; opened at first use
        self.pairs = 0  # data links carried so far
        self.probes = 0  # probe links (a pair of members measuring their relayed link)

    def ticket(self, probe: bool = False) -> str:
        ticket = secrets.token_hex(TICKET_CHARS // 2)
        with self._lock:
            now = time.monotonic()
            self._tickets = {t: kept for t, kept in self._tickets.items() if kept[0] > now}
            self._tickets[ticket] = (now + PAIR_WAIT_S, probe)
        return ticket

    def serve(self, sock: socket.socket, address: tuple) -> None:
        """A connection that opened with RELAY_MAGIC (read already): its ticket, then the pipe."""
        admission = self._waiters()
        peer = f"{address[0]}:{address[1]}"
        try:
            ticket = read_exactly(sock, TICKET_CHARS, PAIR_WAIT_S).decode("ascii", "replace")
        except OSError as exc:
            admission.refused(peer, f"it gave no relay ticket: {exc}")
            sock.close()
            return
        with self._lock:
            lapses, probe = self._tickets.get(ticket, (0.0, False))
            live = lapses > time.monotonic()
            partner = self._waiting.pop(ticket, None) if live else None
            if live and partner is None:
                self._waiting[ticket] = (sock, admission.admit(sock, str(address[0])))
            elif live:
                del self._tickets[ticket]  # one link per ticket
                self.probes += probe
                self.pairs += not probe
        if not live:
            admission.refused(peer, "unknown or lapsed relay ticket")
            sock.close()
        elif partner is not None:
            admission.release(partner[1])
            self._pipe(partner[0], sock)
        else:
            threading.Timer(PAIR_WAIT_S, self._lapse, args=(ticket,)).start()

    def _waiters(self) -> Admission:
        with self._lock:
            if self._admission is None:
                self._admission = Admission("relay", PAIR_WAIT_S)
            return self._admission

    def _lapse(self, ticket: str) -> None:
        with self._lock:
            waiting = self._waiting.pop(ticket, None)
            self._tickets.pop(ticket, None)
        if waiting is not None:
            self._waiters().release(waiting[1])
            log.warning("relay ticket lapsed: the link's other end never came")
            waiting[0].close()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        for source, sink in ((a, b), (b, a)):
            threading.Thread(
                target=_copy, args=(source, sink), daemon=True, name="seamline-relay"
            ).start()


def _copy(source: socket.socket, sink: socket.socket) -> None:
    """One direction of a pipe. An end that reads nothing for ``RELAY_SEND_S`` ends the pipe,
    rather than holding both copies' threads forever."""
    try:
        while data := source.recv(CHUNK):
            send_by(sink, [data], time.monotonic() + RELAY_SEND_S)
    except (OSError, TimeoutError):
        pass
    finally:
        for sock in (source, sink):  # wakes the other direction's reader too
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        source.close()  # each direction closes the socket it read
