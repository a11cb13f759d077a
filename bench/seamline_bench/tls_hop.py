"""What TLS adds to one hop, apart from everything else a mesh does: one decode step's hidden-state
frame sent and received over a socket pair, plaintext and mutual TLS (certificates from a
throwaway mesh CA), on one thread, alternating, the median of several runs.

A whole mesh's per-token time on this shared machine spreads by more than the figure being
measured; this isolates it (``bench split`` reports both).
"""

from __future__ import annotations

import socket
import statistics
import threading
import time

import torch

from seamline.mesh.identity import MeshAuthority
from seamline.net.frames import EMPTY_HASH, Row, RowFlag
from seamline.net.link import Link
from seamline.net.tls import TlsSocket

BATCH_BYTES = 64 << 10  # frames in flight per batch: within a socket pair's buffer


def link_pair(authority: MeshAuthority | None) -> tuple[Link, Link]:
    """Two connected links: plaintext, or mutual TLS under ``authority``'s certificates."""
    one, two = socket.socketpair()
    if authority is None:
        return Link(one, "a"), Link(two, "b")
    accepted: dict[str, TlsSocket] = {}
    server = threading.Thread(
        target=lambda: accepted.update(
            b=TlsSocket.handshake(two, authority.identity("b", 600).server_context(), True, 10.0)
        )
    )
    server.start()
    client = TlsSocket.handshake(one, authority.identity("a", 600).client_context(), False, 10.0)
    server.join()
    return Link(client, "a"), Link(accepted["b"], "b")


def _ms_per_frame(sender: Link, receiver: Link, hidden: int, frames: int) -> float:
    row = Row(
        request=1,
        position=7,
        count=1,
        hash_before=EMPTY_HASH,
        hash_after=1,
        flags=int(RowFlag.SAMPLE),
    )
    tensor = torch.zeros(1, hidden)
    batch = max(1, BATCH_BYTES // (hidden * 4 + 64))
    began = time.perf_counter()
    for _ in range(frames // batch):
        for _ in range(batch):
            sender.send_hidden([row], tensor)
        for _ in range(batch):
            receiver.recv()
    return (time.perf_counter() - began) / (frames // batch * batch) * 1e3


def tls_per_hop(hidden: int, runs: int = 7, frames: int = 5000) -> dict[str, float]:
    """Milliseconds to send and receive one decode frame, plaintext and TLS, and the difference."""
    authority = MeshAuthority.create()
    links = {"plain": link_pair(None), "tls": link_pair(authority)}
    took: dict[str, list[float]] = {name: [] for name in links}
    try:
        for _ in range(runs):
            for name, (sender, receiver) in links.items():
                took[name].append(_ms_per_frame(sender, receiver, hidden, frames))
    finally:
        for pair in links.values():
            for link in pair:
                link.close()
    plain, tls = statistics.median(took["plain"]), statistics.median(took["tls"])
    return {
        "plain_ms_per_frame": round(plain, 4),
        "tls_ms_per_frame": round(tls, 4),
        "tls_ms_per_hop": round(tls - plain, 4),
    }
