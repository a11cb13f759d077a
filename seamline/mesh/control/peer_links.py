"""Links between members as the members measured them, for the planner.

When a node joins, the coordinator asks, for each member already checked, one node of the pair
to measure the link to the other (``MeasurePeer``; ``mesh.node.peer_probe``) and waits for its
``PeerLink``. A pair that takes the relay (one end takes no inbound connection) is measured
through the relay, as its data links will go. A node's report is taken only for a pair it was
asked to measure. A pair whose probe failed is planned from the two access links instead
(``link_probe.link_table``).
"""

from __future__ import annotations

import logging
import threading

from seamline.mesh.plan.types import LinkCost
from seamline.mesh.protocol.link_probe import unphysical
from seamline.net.messages import PeerLink

log = logging.getLogger("seamline.coordinator")
PEER_TIMEOUT_S = 15.0  # a relayed probe may wait for both ends to dial the relay


class PeerLinks:
    def __init__(self) -> None:
        self._measured: dict[tuple[str, str], LinkCost] = {}
        self._relayed: set[tuple[str, str]] = set()
        self._asked: dict[
            tuple[str, str], PeerLink | None
        ] = {}  # (prober, peer) -> its report, once come
        self._cond = threading.Condition()
        self.lock = (
            threading.Lock()
        )  # joins measure in turn: each sees every member checked before it

    def ask(self, prober: str, peer: str) -> None:
        with self._cond:
            self._asked[(prober, peer)] = None

    def report(self, prober: str, report: PeerLink) -> bool:
        """A node's report; False (and dropped) unless it was asked for exactly this pair."""
        key = (prober, report.peer_node)
        with self._cond:
            if key not in self._asked or self._asked[key] is not None:
                return False
            self._asked[key] = report
            self._cond.notify_all()
        return True

    def wait(
        self, prober: str, peer: str, relayed: bool, timeout_s: float = PEER_TIMEOUT_S
    ) -> LinkCost | None:
        """The pair's link once ``prober`` reports it; None when it failed or did not come."""
        key = (prober, peer)
        with self._cond:
            self._cond.wait_for(lambda: self._asked.get(key) is not None, timeout=timeout_s)
            report = self._asked.pop(key, None)
        link, why = _taken(report)
        if link is None:
            log.warning(
                "the link between %s and %s was not measured (%s): planned from their access links",
                prober,
                peer,
                why,
            )
            return None
        with self._cond:
            self._measured[key] = link
            if relayed:
                self._relayed.add(key)
        log.info(
            "link %s - %s%s: %.3f ms round trip, %.0f MB/s",
            prober,
            peer,
            " (relayed)" if relayed else "",
            link.latency_s * 2e3,
            link.bandwidth_bytes_per_s / 1e6,
        )
        return link

    def measured(self) -> dict[tuple[str, str], LinkCost]:
        with self._cond:
            return dict(self._measured)

    def describe(self) -> list[dict[str, object]]:
        """For /api/status: each measured pair."""
        with self._cond:
            return [
                {
                    "nodes": list(key),
                    "relayed": key in self._relayed,
                    "rtt_ms": round(link.latency_s * 2e3, 3),
                    "bandwidth_mb_s": round(link.bandwidth_bytes_per_s / 1e6, 1),
                }
                for key, link in self._measured.items()
            ]

    def forget(self, node_id: str) -> None:
        """A member left: its pairs are measured again if it comes back, and a measurement of a
        pair of it that is awaited ends now (a join waits for no report from a node gone)."""
        with self._cond:
            for key in [k for k in self._measured if node_id in k]:
                del self._measured[key]
                self._relayed.discard(key)
            for prober, peer in [k for k, got in self._asked.items() if node_id in k and not got]:
                self._asked[(prober, peer)] = PeerLink(
                    peer_node=peer, error=f"node {node_id} left the mesh"
                )
            self._cond.notify_all()


def _taken(report: PeerLink | None) -> tuple[LinkCost | None, str]:
    """The link a report measured, or None and why it is not taken (a failure, or a
    measurement no real link gives: a member's word is checked against physics)."""
    if report is None or report.error:
        return None, report.error if report is not None else "no report"
    link = LinkCost(latency_s=report.latency_s, bandwidth_bytes_per_s=report.bandwidth_bytes_per_s)
    refusal = unphysical(link)
    return (None, f"refused: {refusal}") if refusal else (link, "")
