"""Measuring the link to another member, when the coordinator asks (``MeasurePeer``).

The prober dials the peer's data port (or the relay, with a ticket: then the peer dials out
too and the pair is measured along the path its data links will take), checks that the peer's
certificate names the peer it was sent to, and says ``ProbeHello`` instead of a data hello.
The peer answers a few pings, bare and padded, then closes the link: a probe link carries
nothing else, and only a member (a certificate from the mesh CA naming the hello's node) may
open one. The prober reports one-way latency and bandwidth (``PeerLink``).
"""

from __future__ import annotations

import ssl
import time

from seamline.mesh.protocol.link_probe import PAD_BYTES, PADDED_PINGS, PINGS, measure_link
from seamline.mesh.protocol.relay_wire import PAIR_WAIT_S, RELAY_MAGIC
from seamline.net.frames import HANDSHAKE_DEADLINE_S, HANDSHAKE_LIMITS, FrameError, FrameType
from seamline.net.link import Link, LinkClosed
from seamline.net.messages import Challenge, MeasurePeer, PeerLink, Ping, Pong, ProbeHello
from seamline.net.tls import TlsRefused

PROBE_PINGS = PINGS + PADDED_PINGS  # a probe link answers this many pings, then closes
PROBE_LIMITS = {
    **HANDSHAKE_LIMITS,
    FrameType.CONTROL: PAD_BYTES + (4 << 10),
}  # a padded ping and its envelope


class ProbeRefused(Exception):
    pass


def probe_peer(ask: MeasurePeer, node_id: str, tls: ssl.SSLContext | None) -> PeerLink:
    """Measure the link to ``ask.peer_node`` as ``node_id``; a PeerLink with ``error`` if it failed."""
    preamble = RELAY_MAGIC + ask.relay.encode() if ask.relay else b""
    try:
        with Link.connect(
            ask.host,
            ask.port,
            name=f"probe to {ask.peer_node}",
            tls=tls,
            preamble=preamble,
            timeout=PAIR_WAIT_S if ask.relay else HANDSHAKE_DEADLINE_S,
        ) as link:
            if tls is not None and link.peer_id() != ask.peer_node:
                raise ProbeRefused(f"the peer presented a certificate for {link.peer_id()!r}")
            link.limits = HANDSHAKE_LIMITS
            if not isinstance(link.recv(deadline_s=HANDSHAKE_DEADLINE_S), Challenge):
                raise ProbeRefused("the peer sent no challenge")
            link.send_message(ProbeHello(node_id=node_id))
            measured = measure_link(lambda nonce, pad: _round_trip(link, nonce, pad))
    except (OSError, LinkClosed, FrameError, TlsRefused, ProbeRefused) as exc:
        return PeerLink(peer_node=ask.peer_node, error=str(exc) or type(exc).__name__)
    return PeerLink(
        peer_node=ask.peer_node,
        latency_s=measured.latency_s,
        bandwidth_bytes_per_s=measured.bandwidth_bytes_per_s,
    )


def _round_trip(link: Link, nonce: int, pad: str) -> float:
    began = time.perf_counter()
    link.send_message(Ping(nonce=nonce, pad=pad))
    pong = link.recv(deadline_s=HANDSHAKE_DEADLINE_S)
    if not isinstance(pong, Pong) or pong.nonce != nonce:
        raise ProbeRefused(f"the peer answered ping {nonce} with {type(pong).__name__}")
    return time.perf_counter() - began


def answer_probe(link: Link) -> None:
    """The probed end: answer up to PROBE_PINGS pings, each within the handshake deadline, then
    close. Anything else ends the link (ProbeRefused)."""
    link.limits = PROBE_LIMITS
    try:
        for _ in range(PROBE_PINGS):
            ping = link.recv(deadline_s=HANDSHAKE_DEADLINE_S)
            if not isinstance(ping, Ping):
                raise ProbeRefused(f"a probe link sent {type(ping).__name__}")
            link.send_message(Pong(nonce=ping.nonce))
    finally:
        link.close()
