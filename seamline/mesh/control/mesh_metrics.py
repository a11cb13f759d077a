"""What a mesh's ``/metrics`` says of its nodes and links, asked of the coordinator at a scrape.

A node is up while it serves in the current plan; a node that was ever a member (the
coordinator's ``NodeAdmitted`` events) and is gone stays listed, down. The coordinator's events
are counted by kind. Each stage's mean decode step, KV bytes and the bytes its data links carried come
from the stages' counters (a stage that does not answer within ``STATS_TIMEOUT_S`` is listed
without them); round trips are the coordinator's measurements: each member's link to it, and
the links members measured between them.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING

from seamline.errors import SeamlineError
from seamline.mesh.control.mesh_state import Event, MeshState, NodeAdmitted
from seamline.net.link import LinkClosed
from seamline.net.messages import Stats
from seamline.runtime.reports import LinkReport, MeshReport, NodeReport
from seamline.runtime.speculation import speculated

if TYPE_CHECKING:
    from seamline.mesh.control.coordinator import Coordinator

STATS_TIMEOUT_S = 2.0
COORDINATOR = "coordinator"  # the coordinator's name in link labels


class MeshReporter:
    """A listener of the coordinator's events, and what /metrics asks at each scrape."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.seen: dict[str, None] = {}  # every node ever a member, in order
        self.events: Counter[str] = Counter()  # by kind
        self._lock = threading.Lock()
        coordinator.keeper.listen(self.hear)

    def hear(self, event: Event, state: MeshState) -> None:
        with self._lock:
            self.events[event.kind] += 1
            if isinstance(event, NodeAdmitted):
                self.seen[event.handle.node_id] = None

    def __call__(self) -> MeshReport:
        c = self.coordinator
        state = c.keeper.current
        serving = (
            {n for s in state.plan.stages for n in s.members()}
            if state.plan and state.ready
            else set()
        )
        members = dict(state.nodes)
        with self._lock:
            seen, events = list(self.seen), dict(self.events)
        stats = {s.node_id: s for s in self._stats()}
        nodes = [_node(n, n in serving and n in members, stats.get(n)) for n in seen]
        links = [
            LinkReport(n, COORDINATOR, rtt_seconds=h.measured.latency_s * 2)
            for n, h in members.items()
            if h.measured is not None
        ]
        for pair in c.peer_links.describe():
            src, dst = pair["nodes"]  # type: ignore[misc]
            links.append(LinkReport(str(src), str(dst), rtt_seconds=float(pair["rtt_ms"]) / 1e3))  # type: ignore[arg-type]
        for node, stat in stats.items():
            links += [
                LinkReport(node, peer, bytes_total=sent) for peer, sent in stat.link_bytes.items()
            ]
        return MeshReport(nodes, links, events, speculation=speculated(stats.values()))

    def _stats(self) -> list[Stats]:
        if not self.coordinator.ready.is_set():
            return []
        try:
            return self.coordinator.stage_stats(timeout_s=STATS_TIMEOUT_S)
        except (SeamlineError, LinkClosed, TimeoutError):
            return []


def _node(node: str, up: bool, stat: Stats | None) -> NodeReport:
    if stat is None:
        return NodeReport(node, up)
    step = stat.decode_seconds / stat.decode_steps if stat.decode_steps else None
    return NodeReport(node, up, step, stat.kv_bytes + stat.kept_kv_bytes)
