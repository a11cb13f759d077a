"""Heartbeats: the coordinator pings every member each ``every_s`` seconds, with a fresh random
nonce, and a member that has answered no ping for ``timeout_s`` is lost (so is one that has sent
nothing at all that long). A ping's answer proves the member reads its link: a member that
stops reading but keeps sending cannot answer a nonce it never read. This catches a node that stops without closing its sockets (SIGSTOP, a pulled cable),
which a closed link never would; a node likewise takes its coordinator for lost when it hears
nothing from it (``mesh.node.process.COORDINATOR_SILENT_S``).

A member that keeps talking but stops reading is lost too: when a send to it has got no byte
out for ``timeout_s``, or its link has had no room for a beat that long. A beat never waits:
it is skipped while another thread sends on the link or the link has no room, so one member
that reads nothing cannot hold up the beats of the others. Losing one is left to a thread of
its own (a re-plan may follow), its link closed first: that frees a sender stuck on it."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from seamline.mesh.protocol.link_probe import new_nonce
from seamline.net.link import LinkClosed
from seamline.net.messages import Ping

if TYPE_CHECKING:
    from seamline.mesh.control.coordinator import Coordinator
    from seamline.mesh.control.node_handle import NodeHandle

log = logging.getLogger("seamline.coordinator")


BEATS_PER_TIMEOUT = 12  # a member is taken for lost at most 1/12 of the timeout after it
MAX_BEAT_S = 0.25  # ...and at most this long (a second apart, a SIGSTOP took 3.0-3.8 s to see)


def watch(coordinator: Coordinator, timeout_s: float) -> threading.Thread:
    """Start the heartbeat thread: a beat ``timeout_s / BEATS_PER_TIMEOUT`` apart (at most
    ``MAX_BEAT_S``). Silence is judged at each beat, so the beat's spacing is how late past
    ``timeout_s`` a stopped member is found lost, and how long its requests wait more."""
    every_s = min(MAX_BEAT_S, timeout_s / BEATS_PER_TIMEOUT)
    thread = threading.Thread(
        target=_beat_forever,
        args=(coordinator, every_s, timeout_s),
        daemon=True,
        name="seamline-heartbeats",
    )
    thread.start()
    return thread


def _beat_forever(coordinator: Coordinator, every_s: float, timeout_s: float) -> None:
    full_since: dict[str, float] = {}  # node id -> since when its link has had no room for a beat
    while True:
        time.sleep(every_s)
        with coordinator.lock:
            handles = list(coordinator.nodes.values())
        for handle in handles:
            reason = _beat(handle, every_s, timeout_s, full_since)
            if reason is not None:
                log.warning("node %s %s: taken for lost", handle.node_id, reason)
                handle.link.close()  # wakes a sender stuck on it
                threading.Thread(
                    target=coordinator.lose, args=(handle, reason), daemon=True
                ).start()
        for gone in full_since.keys() - {h.node_id for h in handles}:
            del full_since[gone]


def _beat(
    handle: NodeHandle, every_s: float, timeout_s: float, full_since: dict[str, float]
) -> str | None:
    """Send ``handle`` a heartbeat if that cannot wait; why it is lost, or None."""
    if handle.link.closed:
        return None  # its reader finds the link closed and reports the loss
    now = time.monotonic()
    silent = now - handle.last_heard
    if silent > timeout_s:
        return f"sent nothing for {silent:.1f} s"
    unanswered = handle.beats.unanswered_for(now)
    if unanswered > timeout_s:
        return f"answered no heartbeat for {unanswered:.1f} s (it reads nothing)"
    stalled = handle.link.stalled_for()
    if stalled > timeout_s:
        return f"read nothing for {stalled:.1f} s (a send to it got no byte out)"
    nonce = new_nonce()
    handle.beats.sent(nonce, now)  # before the send: its pong may come back before the send returns
    try:
        beaten = handle.link.try_send_message(Ping(nonce=nonce), within_s=every_s)
    except LinkClosed:
        return None
    if not beaten:
        handle.beats.cancel(nonce)
    if beaten or stalled:  # busy sending: that send is watched
        full_since.pop(handle.node_id, None)
        return None
    full = now - full_since.setdefault(handle.node_id, now)
    return (
        f"read nothing for {full:.1f} s (its link had no room for a heartbeat)"
        if full > timeout_s
        else None
    )
