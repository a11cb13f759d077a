"""What the planner knows of the links: each node's round trip and bandwidth to the coordinator,
measured over its control link when it joins, whether it takes inbound connections, and each
pair of members' link as the pair measured it (``peer_links``).

A pair not measured (its probe failed) is planned with the slower of its two access links, or,
when one end takes no inbound connection, with their sum: its links go through the relay.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from seamline.mesh.plan.types import LinkCost, LinkTable
from seamline.net.link import Link, LinkClosed
from seamline.net.messages import Ping

log = logging.getLogger("seamline.coordinator")
PINGS = 3
PADDED_PINGS = 2
PAD_BYTES = 256 << 10
PONG_TIMEOUT_S = 5.0
# What a link can physically be: a one-way latency between a microsecond (loopback) and 30 s,
# a bandwidth between 1 kB/s and 100 GB/s. A measurement outside is noise or a lie: refused.
LATENCY_BOUNDS_S = (1e-6, 30.0)
BANDWIDTH_BOUNDS = (1e3, 1e11)


class Pongs:
    """When each Pong came back on a node's control link (its reader records them)."""

    def __init__(self) -> None:
        self._arrived: dict[int, float | None] = {}  # nonce of a ping sent -> when its pong came
        self._cond = threading.Condition()

    def expect(self, nonce: int) -> None:
        with self._cond:
            self._arrived[nonce] = None

    def arrived(self, nonce: int) -> bool:
        """Record a pong; False (ignored) unless its ping was sent and not yet answered."""
        with self._cond:
            if nonce not in self._arrived or self._arrived[nonce] is not None:
                return False
            self._arrived[nonce] = time.perf_counter()
            self._cond.notify_all()
            return True

    def wait(self, nonce: int, timeout_s: float) -> float | None:
        with self._cond:
            self._cond.wait_for(lambda: self._arrived.get(nonce) is not None, timeout=timeout_s)
            return self._arrived.pop(nonce, None)


@dataclass(frozen=True)
class Reach:
    node_id: str
    inbound: bool  # takes connections: peers dial it directly
    link: LinkCost | None  # measured to the coordinator (None: the node did not answer)


def measure(link: Link, pongs: Pongs) -> LinkCost | None:
    """A node's link to the coordinator, over its control link (whose reader collects the pongs)."""
    try:
        measured = measure_link(lambda nonce, pad: _round_trip(link, pongs, nonce, pad))
    except (LinkClosed, TimeoutError) as exc:
        log.warning("could not measure the link to %s: %s", link.name, exc)
        return None
    refusal = unphysical(measured)
    if refusal:
        log.warning(
            "refused the measurement of the link to %s: %s; planned as a default link",
            link.name,
            refusal,
        )
        return None
    return measured


def measure_link(round_trip: Callable[[int, str], float]) -> LinkCost:
    """One-way latency (half the fastest of a few round trips) and bandwidth (a padded ping's
    extra time over a bare one). ``round_trip(nonce, pad)`` pings and times the pong. Nonces
    are random, so no pong can be sent before its ping has come whole (``Ping`` puts the nonce
    after the pad)."""
    bare = [round_trip(new_nonce(), "") for _ in range(PINGS)]
    padded = [round_trip(new_nonce(), "x" * PAD_BYTES) for _ in range(PADDED_PINGS)]
    rtt = min(bare)
    # a pad that cost less than the timing's noise (loopback) reads as the fastest link there is
    extra = max(min(padded) - rtt, PAD_BYTES / BANDWIDTH_BOUNDS[1])
    return LinkCost(latency_s=rtt / 2, bandwidth_bytes_per_s=PAD_BYTES / extra)


def new_nonce() -> int:
    return secrets.randbits(62)


def unphysical(link: LinkCost) -> str:
    """Why ``link`` cannot be a real link's measurement ("" if it can)."""
    low, high = LATENCY_BOUNDS_S
    if not low <= link.latency_s <= high:
        return f"a one-way latency of {link.latency_s * 1e3:.4f} ms is outside [{low * 1e3:g}, {high * 1e3:g}] ms"
    low, high = BANDWIDTH_BOUNDS
    if not low <= link.bandwidth_bytes_per_s <= high:
        return f"a bandwidth of {link.bandwidth_bytes_per_s:.3g} B/s is outside [{low:g}, {high:g}] B/s"
    return ""


def _round_trip(link: Link, pongs: Pongs, nonce: int, pad: str) -> float:
    pongs.expect(nonce)
    began = time.perf_counter()
    link.send_message(Ping(nonce=nonce, pad=pad))
    arrived = pongs.wait(nonce, PONG_TIMEOUT_S)
    if arrived is None:
        raise TimeoutError(f"no pong within {PONG_TIMEOUT_S} s")
    return arrived - began


def link_table(
    reaches: Iterable[Reach], measured: Mapping[tuple[str, str], LinkCost] | None = None
) -> LinkTable:
    """Access links as measured; each pair as its nodes measured it, else (not measured) as the
    slower access link, or their sum when one end takes no inbound connection (relayed)."""
    known = [r for r in reaches if r.link is not None]
    access = {r.node_id: r.link for r in known if r.link is not None}
    pairs = {}
    for a, b in itertools.combinations(known, 2):
        pair = (measured or {}).get((a.node_id, b.node_id)) or (measured or {}).get(
            (b.node_id, a.node_id)
        )
        if pair is not None:
            pairs[(a.node_id, b.node_id)] = pair
        elif not (a.inbound and b.inbound) and a.link is not None and b.link is not None:
            pairs[(a.node_id, b.node_id)] = LinkCost(
                a.link.latency_s + b.link.latency_s,
                min(a.link.bandwidth_bytes_per_s, b.link.bandwidth_bytes_per_s),
            )
    return LinkTable(access=access, pairs=pairs)
