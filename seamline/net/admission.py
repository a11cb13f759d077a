"""Who may hold a connection to a listening port before proving who it is.

Every accepted connection is *pending* until its handler says the peer is authenticated
(``Link.authenticated``). Pending connections are bounded per peer address and on the whole
port, so a process spends at most ``total`` threads on handshakes per port (and those being
cut). A new connection over a bound makes room by cutting the oldest pending one (of its own
address, when that address is over its share): a stranger's idle connections cannot keep a
member out, while a member's handshake, done in milliseconds, is over long before a stranger
could open that many new ones. Each pending connection has one deadline for its whole
handshake (TLS and the first messages): a watchdog cuts it then, however slowly its peer
drips bytes. Cutting shuts the socket, which wakes whatever read or send its handler waits
in. An authenticated connection counts no more. Cuts are logged at most once per
``REFUSAL_LOG_S`` per port, naming the peer and the reason.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import socket
import threading
import time

log = logging.getLogger("seamline.link")

MAX_PENDING_PER_HOST = 64  # unproved connections one address may hold open on one port
MAX_PENDING = 128  # unproved connections on one port, from all addresses together
REFUSAL_LOG_S = 10.0  # at most one line per port this often about connections refused or cut


class Pending:
    """One accepted connection whose peer has not proved itself yet."""

    def __init__(self, port: Admission, host: str, sock: socket.socket, deadline: float) -> None:
        self.port = port
        self.host = host
        self.sock = sock  # the raw socket (under any TLS): shut when cut
        self.deadline = deadline  # time.monotonic() by which the handshake must be done
        self.counted = True  # against the port's bounds (False once proved, cut or gone)

    def proved(self) -> None:
        """The handler has authenticated the peer: no bound or deadline holds it any more."""
        self.port.release(self)


class Admission:
    """The pending connections of one listening port: their bounds and their deadlines."""

    def __init__(
        self,
        name: str,
        deadline_s: float,
        per_host: int = MAX_PENDING_PER_HOST,
        total: int = MAX_PENDING,
    ) -> None:
        self.name, self.deadline_s, self.per_host, self.total = name, deadline_s, per_host, total
        self._all: dict[Pending, None] = {}  # oldest first
        self._by_host: dict[str, dict[Pending, None]] = {}  # oldest first
        self._deadlines: list[
            tuple[float, int, Pending]
        ] = []  # a heap; entries no longer counted are skipped
        self._order = itertools.count()
        self._lock = threading.Condition()
        self._watchdog: threading.Thread | None = None
        self._refused, self._logged = 0, -REFUSAL_LOG_S

    def admit(self, sock: socket.socket, host: str) -> Pending:
        """Count a new connection from ``host``, cutting the oldest pending one over a bound."""
        with self._lock:
            victim, reason = None, ""
            if len(self._by_host.get(host, ())) >= self.per_host:
                victim, reason = (
                    next(iter(self._by_host[host])),
                    f"it held {self.per_host} unproved connections here",
                )
            elif len(self._all) >= self.total:
                victim, reason = (
                    next(iter(self._all)),
                    f"{self.total} unproved connections were open here",
                )
            if victim is not None:
                self._cut(victim)
            pending = Pending(self, host, sock, time.monotonic() + self.deadline_s)
            self._by_host.setdefault(host, {})[pending] = self._all[pending] = None
            heapq.heappush(self._deadlines, (pending.deadline, next(self._order), pending))
            self._lock.notify()
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch, daemon=True, name=f"seamline-deadlines-{self.name}"
                )
                self._watchdog.start()
        if victim is not None:
            self.refused(victim.host, f"{reason}: its oldest was cut for a new one")
        return pending

    def release(self, pending: Pending) -> None:
        """The peer proved itself, or its connection is gone: it counts no more (idempotent)."""
        with self._lock:
            self._forget(pending)

    def refused(self, host: str, reason: str) -> None:
        """Log a refused (or cut) connection: one line per ``REFUSAL_LOG_S``, naming the peer
        and the reason, and how many others went unlogged since."""
        with self._lock:
            self._refused += 1
            now = time.monotonic()
            if now - self._logged < REFUSAL_LOG_S:
                return
            others, self._refused, self._logged = self._refused - 1, 0, now
        more = f" ({others} more refused or cut since the last such line)" if others else ""
        log.warning("refused %s connection from %s: %s%s", self.name, host, reason, more)

    def _forget(self, pending: Pending) -> bool:
        """Stop counting ``pending`` (under the lock); whether it was still counted."""
        if not pending.counted:
            return False
        pending.counted = False
        del self._all[pending]
        mine = self._by_host[pending.host]
        del mine[pending]
        if not mine:
            del self._by_host[pending.host]
        return True

    def _cut(self, pending: Pending) -> bool:
        """Shut a pending connection (under the lock: a peer proved at this instant keeps its
        link); its handler fails at once and ends. Whether it was still pending."""
        if not self._forget(pending):
            return False
        try:
            pending.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return True

    def _watch(self) -> None:
        """Cut every connection still unproved at its deadline."""
        while True:
            with self._lock:
                while not self._deadlines or self._deadlines[0][0] > time.monotonic():
                    self._lock.wait(
                        self._deadlines[0][0] - time.monotonic() if self._deadlines else None
                    )
                _, _, pending = heapq.heappop(self._deadlines)
                late = self._cut(pending)
            if late:
                self.refused(pending.host, f"no handshake within {self.deadline_s:g} s in all")
