"""An HTTPS listener bounded before TLS: uvicorn serves its connections, this module accepts them.

asyncio tells a protocol of a TLS connection only once the handshake is done, so uvicorn's guard
(``http_guard``) never sees a connection that sends no ClientHello: asyncio holds each for its
own 60 s handshake timeout, and a stranger's idle connections take every descriptor the process
has. Here the raw socket is accepted on a thread of the port's own and counted at once as one of
the port's unproved connections (``net.admission``: bounded per address, per port and in the
process, the oldest cut for a new one, the handshake cut ``HANDSHAKE_DEADLINE_S`` after the
connection opened); then uvicorn's event loop runs its TLS handshake, whose end proves it.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading

import uvicorn

from seamline.net.admission import Admission, Pending
from seamline.net.frames import HANDSHAKE_DEADLINE_S
from seamline.net.link import _accept_forever

# asyncio's own cut comes later than the admission's: the admission cuts by shutting the socket,
# so it never shuts a descriptor number the event loop has already closed and handed on
LOOP_HANDSHAKE_S = HANDSHAKE_DEADLINE_S + 5


class GatedServer(uvicorn.Server):
    """uvicorn serving, over TLS under ``context``, what ``listener`` accepts, each connection
    admitted as it is accepted. Run it with the "asyncio" loop: its transport closes the very
    socket object the admission holds, so a cut that comes late finds it closed."""

    def __init__(
        self, config: uvicorn.Config, listener: socket.socket, context: ssl.SSLContext, name: str
    ) -> None:
        super().__init__(config)
        self.listener, self.context, self.name = listener, context, name
        self.admission: Admission | None = None  # opened with the server

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # the app's lifespan and state; no listener of its own
        loop = asyncio.get_running_loop()
        admission = self.admission = Admission(self.name, HANDSHAKE_DEADLINE_S)

        def take(sock: socket.socket, address: tuple) -> None:  # on the accept thread
            pending = admission.admit(sock, str(address[0]))
            try:
                asyncio.run_coroutine_threadsafe(self._handshake(sock, address, pending), loop)
            except BaseException:  # the loop is gone: the port is closing
                admission.release(pending)
                sock.close()
                raise

        threading.Thread(
            target=_accept_forever,
            args=(self.listener, self.name, take),
            name=f"seamline-accept-{self.name}",
            daemon=True,
        ).start()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # the one thing that ends an accept loop
        except OSError:
            pass
        self.listener.close()
        if self.admission is not None:
            self.admission.close()
        await super().shutdown(sockets)

    async def _handshake(self, sock: socket.socket, address: tuple, pending: Pending) -> None:
        """TLS on an admitted socket; a failed handshake is logged (once per while) as refused."""
        assert self.admission is not None
        loop = asyncio.get_running_loop()
        try:
            await _readable(loop, sock)
            if not pending.counted:  # cut while it sent nothing: no TLS state is made for it
                sock.close()
                return
            await loop.connect_accepted_socket(
                self._protocol, sock, ssl=self.context, ssl_handshake_timeout=LOOP_HANDSHAKE_S
            )
        except (OSError, asyncio.TimeoutError) as exc:  # ssl.SSLError is an OSError
            if pending.counted:  # not cut already (a cut is logged as such)
                reason = f"TLS handshake failed: {exc or type(exc).__name__}"
                self.admission.refused(f"{address[0]}:{address[1]}", reason)
        finally:
            self.admission.release(pending)

    def _protocol(self) -> asyncio.Protocol:
        """A connection's HTTP protocol, as uvicorn's own listener would make it."""
        return self.config.http_protocol_class(  # type: ignore[call-arg]
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state
        )


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Until the peer has sent something (its ClientHello) or the socket is cut: asyncio's TLS
    takes a 256 KiB buffer per connection, which a connection that sends nothing never costs."""
    sock.setblocking(False)
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, LOOP_HANDSHAKE_S)
    finally:
        loop.remove_reader(sock.fileno())
