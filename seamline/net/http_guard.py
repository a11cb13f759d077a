"""Bounded HTTP listeners: uvicorn's protocol with the bounds the mesh's own ports keep.

uvicorn holds a connection that never sends a request for as long as its peer likes, so an
attacker's idle connections take every descriptor, after which the server accepts each new
connection and drops it. ``guarded`` wraps uvicorn's HTTP protocol: a connection must have sent
a whole request head within ``HEAD_DEADLINE_S`` of opening (a dripped head included) or it is
closed, and connections that have not (yet) begun a request are bounded per peer address and in
all, a new one over a bound closing the oldest such. A connection inside a request (a stream
being answered) is never cut; between requests uvicorn's keep-alive timeout applies.
``raise_descriptor_limit`` lifts the soft descriptor limit to the hard one, as servers do.

The listen backlog is bounded too (``bounded``): the event loop accepts every queued connection
at once, before the guard closes any, and one that runs out of descriptors mid-burst (libuv)
accepts and drops what is left in the queue, clients' new connections among them.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from seamline.net.admission import descriptor_shares

log = logging.getLogger("seamline.http")
HEAD_DEADLINE_S = 10.0
MAX_WAITING_PER_ADDRESS = 64  # connections with no request begun, from one address
MAX_WAITING = 512  # and from all, at most a port's share of the descriptors (``admission``)
LOG_EVERY_S = 10.0
MAX_BACKLOG = 2048  # uvicorn's own


class _Waiting:
    """Connections with no request begun, oldest first, on one event loop."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.connections: OrderedDict[Any, str] = OrderedDict()
        self.cut = 0
        self._logged = 0.0

    def add(self, protocol: Any, address: str) -> None:
        self.connections[protocol] = address
        mine = [p for p, a in self.connections.items() if a == address]
        if len(mine) > MAX_WAITING_PER_ADDRESS:
            self._cut(
                mine[0],
                f"{address} holds {MAX_WAITING_PER_ADDRESS} connections that sent no request",
            )
        if len(self.connections) > self.bound:
            self._cut(next(iter(self.connections)), f"{self.bound} connections sent no request")

    def _cut(self, protocol: Any, why: str) -> None:
        self.connections.pop(protocol, None)
        protocol.transport.close()
        self.cut += 1
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S:
            log.warning("closed %d idle HTTP connection(s), the oldest first: %s", self.cut, why)
            self._logged, self.cut = now, 0


def guarded(base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (``base``, by default the one it would choose) with the bounds."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    waiting = _Waiting(min(MAX_WAITING, descriptor_shares().per_port))

    class Guarded(base):  # type: ignore[valid-type,misc]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            peer = transport.get_extra_info("peername") or ("?",)
            waiting.add(self, str(peer[0]))
            self._head_timer = asyncio.get_running_loop().call_later(HEAD_DEADLINE_S, self._no_head)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if getattr(self, "cycle", None) is not None:  # a request's head came whole
                self._begun()

        def _begun(self) -> None:
            waiting.connections.pop(self, None)
            self._head_timer.cancel()

        def _no_head(self) -> None:
            if getattr(self, "cycle", None) is None:
                waiting.connections.pop(self, None)
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._begun()
            super().connection_lost(exc)

    return Guarded


def bounded(base: type[asyncio.Protocol] | None = None) -> dict[str, Any]:
    """uvicorn's keyword arguments for a bounded listener: the guarded protocol and a backlog
    that one burst of accepts cannot take past an eighth of the process's descriptors."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return {"http": guarded(base), "backlog": max(64, min(MAX_BACKLOG, soft // 8))}


def serve_once_listening(
    app: Any, announce: Callable[[], None], host: str, port: int, **config: Any
) -> None:
    """Serve ``app`` with uvicorn (bounded) on a socket that listens before ``announce`` prints
    where: a client that connects as soon as it reads the address waits in the backlog until
    the event loop accepts it, rather than being refused."""
    import uvicorn

    settings = uvicorn.Config(app, host=host, port=port, **bounded(), **config)
    sock = settings.bind_socket()
    sock.listen(settings.backlog)
    announce()
    if not settings.is_ssl:
        uvicorn.Server(settings).run(sockets=[sock])
        return
    from seamline.net.tls_gate import GatedServer  # asyncio shows a TLS connection only once

    settings.loop = "asyncio"  # it has shaken hands: it is admitted at the accept (``tls_gate``)
    settings.load()
    GatedServer(settings, sock, settings.ssl, "API").run()


def raise_descriptor_limit() -> int:
    """Lift the soft limit on open files to the hard one; the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
        except (ValueError, OSError):
            pass
    return soft
