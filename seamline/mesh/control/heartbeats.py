"""Heartbeats: the coordinator tells every member it is there each ``every_s`` seconds, and a
member that has sent nothing (a heartbeat answered, tokens, anything) for ``timeout_s`` is
lost. This catches a node that stops without closing its sockets (SIGSTOP, a pulled cable),
which a closed link never would; a node likewise takes its coordinator for lost when it hears
nothing from it (``mesh.node.process.COORDINATOR_SILENT_S``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from seamline.net.link import LinkClosed
from seamline.net.messages import Heartbeat

if TYPE_CHECKING:
    from seamline.mesh.control.coordinator import Coordinator

log = logging.getLogger("seamline.coordinator")


def watch(coordinator: Coordinator, timeout_s: float) -> threading.Thread:
    """Start the heartbeat thread: a beat a third of ``timeout_s`` apart (at most a second)."""
    every_s = min(1.0, timeout_s / 3)
    thread = threading.Thread(target=_beat_forever, args=(coordinator, every_s, timeout_s), daemon=True,
                              name="seamline-heartbeats")  # fmt: skip
    thread.start()
    return thread


def _beat_forever(coordinator: Coordinator, every_s: float, timeout_s: float) -> None:
    while True:
        time.sleep(every_s)
        with coordinator.lock:
            handles = list(coordinator.nodes.values())
        now = time.monotonic()
        for handle in handles:
            silent = now - handle.last_heard
            if silent > timeout_s:
                log.warning("node %s sent nothing for %.1f s: taken for lost", handle.node_id, silent)
                coordinator.lose(handle, f"no heartbeat for {silent:.1f} s")
                continue
            try:
                handle.link.send_message(Heartbeat())
            except LinkClosed:
                pass  # its reader finds the link closed and reports the loss
