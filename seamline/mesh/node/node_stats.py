"""What a node answers a StatsRequest with: its stage's counters (``/api/status``, the balance
watch)."""

from __future__ import annotations

from collections.abc import Mapping

from seamline.mesh.node.node_precision import stage_precision
from seamline.net.link import Link
from seamline.net.messages import Assign, Stats
from seamline.runtime.stage_worker import StageWorker


def stage_stats(
    node_id: str, worker: StageWorker, data_links: Mapping[str, Link], assign: Assign | None
) -> Stats:
    """``worker``'s counters now, and the bytes sent on each of the node's data links."""
    return Stats(
        node_id=node_id,
        decode_steps=worker.decode_steps,
        decode_seconds=worker.decode_seconds,
        refused_frames=worker.refused,
        link_bytes={peer: link.bytes_sent for peer, link in data_links.items()},
        precision=stage_precision(assign),
        step_probe_s=worker.step_probe,
        prompt_probe_s=worker.prompt_probe,
        step_overhead_s=worker.clock.overhead_s(),
        probe_quiet=worker.probe_quiet,
        cycle_wall_s=worker.clock.cycle_wall_s(),
        ring_s=worker.head.ring.ring_s() if worker.head else 0.0,
        busy_seconds=worker.busy_seconds,
        idle_seconds=worker.idle.seconds(),
        **worker.holdings(),
        **worker.speculated(),
    )
