"""What the planner knows of the links: each node's round trip and bandwidth to the coordinator,
measured over its control link when it joins, and whether it takes inbound connections.

A pair of nodes is planned with the slower of their two links (``LinkTable``'s access links);
a pair with a node that takes no inbound connection goes through the coordinator's relay, so
its latency is the sum of both nodes' links.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from seamline.mesh.control.relay import Pongs
from seamline.mesh.plan.types import Link as PlanLink
from seamline.mesh.plan.types import LinkTable
from seamline.net.link import Link, LinkClosed
from seamline.net.messages import Ping

log = logging.getLogger("seamline.coordinator")
PINGS = 3
PAD_BYTES = 256 << 10
PONG_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Reach:
    node_id: str
    inbound: bool  # takes connections: peers dial it directly
    link: PlanLink | None  # measured to the coordinator (None: the node did not answer)


def measure(link: Link, pongs: Pongs) -> PlanLink | None:
    """One-way latency (half the fastest of a few round trips) and bandwidth (a padded ping's
    extra time over a bare one)."""
    nonces = itertools.count(1)
    try:
        bare = [_round_trip(link, pongs, next(nonces), "") for _ in range(PINGS)]
        padded = [_round_trip(link, pongs, next(nonces), "x" * PAD_BYTES) for _ in range(2)]
    except (LinkClosed, TimeoutError) as exc:
        log.warning("could not measure the link to %s: %s", link.name, exc)
        return None
    rtt = min(bare)
    return PlanLink(latency_s=rtt / 2, bandwidth_bytes_per_s=PAD_BYTES / max(min(padded) - rtt, 1e-6))


def _round_trip(link: Link, pongs: Pongs, nonce: int, pad: str) -> float:
    began = time.perf_counter()
    link.send_message(Ping(nonce=nonce, pad=pad))
    arrived = pongs.wait(nonce, PONG_TIMEOUT_S)
    if arrived is None:
        raise TimeoutError(f"no pong within {PONG_TIMEOUT_S} s")
    return arrived - began


def link_table(reaches: Iterable[Reach]) -> LinkTable:
    """Access links as measured; a pair with a node that takes no inbound connection as relayed."""
    known = [r for r in reaches if r.link is not None]
    access = {r.node_id: r.link for r in known if r.link is not None}
    pairs = {}
    for a, b in itertools.combinations(known, 2):
        if not (a.inbound and b.inbound) and a.link is not None and b.link is not None:
            pairs[(a.node_id, b.node_id)] = PlanLink(a.link.latency_s + b.link.latency_s,
                                                     min(a.link.bandwidth_bytes_per_s, b.link.bandwidth_bytes_per_s))  # fmt: skip
    return LinkTable(access=access, pairs=pairs)
