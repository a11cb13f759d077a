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

Every port of a process draws on one pool too (``descriptor_shares``): the descriptor limit
less a reserve (a quarter: /health, proved control and data links, files) less the API's own
share (its HTTP guard counts apart). A port is held to a third of what is left; when the pool is
full, a new connection anywhere cuts the oldest pending one of the port holding the most, so a
flood at one port cannot take the descriptors another needs.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import resource
import socket
import threading
import time
import weakref
from dataclasses import dataclass

log = logging.getLogger("seamline.link")

MAX_PENDING_PER_HOST = 64  # unproved connections one address may hold open on one port
MAX_PENDING = 128  # unproved connections on one port, from all addresses together
REFUSAL_LOG_S = 10.0  # at most one line per port this often about connections refused or cut
RESERVE_SHARE = 4  # 1/4 of the descriptors never goes to unproved connections
UNLIMITED = 1 << 20  # the descriptors taken to be had under an unlimited RLIMIT_NOFILE


@dataclass(frozen=True)
class Shares:
    """How a process's descriptor limit is shared among its ports' unproved connections."""

    limit: int  # the soft RLIMIT_NOFILE
    unproved: int  # every port's unproved connections together: the limit less the reserve
    per_port: int  # one port's (the API's guard, or an Admission's) at most

    @property
    def pool(self) -> int:
        """The Admission ports' unproved connections together (the API's guard counts apart)."""
        return max(self.per_port, self.unproved - self.per_port)


def descriptor_shares() -> Shares:
    """The shares under the soft descriptor limit now: a listener sizes its bounds as it opens."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    soft = UNLIMITED if soft == resource.RLIM_INFINITY else soft
    unproved = soft - soft // RESERVE_SHARE
    return Shares(soft, unproved, max(16, unproved // 3))


class _DescriptorPool:
    """Every Admission port of the process, under one lock and one bound on their pending
    connections together."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ports: weakref.WeakSet[Admission] = weakref.WeakSet()
        self.bound = descriptor_shares().pool

    def pending(self) -> int:
        return sum(len(port._all) for port in self.ports)

    def fullest(self) -> Admission:
        return max(self.ports, key=lambda port: len(port._all))


_POOL = _DescriptorPool()


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
        shares = descriptor_shares()
        total = max(1, min(total, shares.per_port))
        self.name, self.deadline_s, self.per_host, self.total = (
            name,
            deadline_s,
            min(per_host, total),
            total,
        )
        self._all: dict[Pending, None] = {}  # oldest first
        self._by_host: dict[str, dict[Pending, None]] = {}  # oldest first
        self._deadlines: list[
            tuple[float, int, Pending]
        ] = []  # a heap; entries no longer counted are skipped
        self._order = itertools.count()
        self._lock = threading.Condition(_POOL.lock)  # one lock for the process's ports
        self._watchdog: threading.Thread | None = None
        self._refused, self._logged = 0, -REFUSAL_LOG_S
        self._closed = False
        with self._lock:
            _POOL.bound = shares.pool
            _POOL.ports.add(self)

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
            elif _POOL.pending() >= _POOL.bound:
                victim, reason = (
                    next(iter(_POOL.fullest()._all)),
                    f"{_POOL.bound} unproved connections were open in this process",
                )
            if victim is not None:
                victim.port._cut(victim)
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
            victim.port.refused(victim.host, f"{reason}: the oldest was cut for a new one")
        return pending

    def close(self) -> None:
        """The port is closed: cut what is still pending, end the watchdog, leave the pool."""
        with self._lock:
            for pending in list(self._all):
                self._cut(pending)
            self._closed = True
            self._lock.notify()
            _POOL.ports.discard(self)

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
                while not self._closed and (
                    not self._deadlines or self._deadlines[0][0] > time.monotonic()
                ):
                    self._lock.wait(
                        self._deadlines[0][0] - time.monotonic() if self._deadlines else None
                    )
                if self._closed:
                    return
                _, _, pending = heapq.heappop(self._deadlines)
                late = self._cut(pending)
            if late:
                self.refused(pending.host, f"no handshake within {self.deadline_s:g} s in all")
