"""A node's stage made ready to serve: the room check before anything is fetched, the download's
progress reports, the worker around a loaded stage (its KV budget) and the READY that tells the
coordinator what this node now holds (``Node._load_here``); the stage's speed probe waits until
it is idle after READY (``idle_probe``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import psutil
import torch

from seamline.mesh.node.credentials import Credentials
from seamline.mesh.node.fetch import FetchReport
from seamline.model.stage import Stage
from seamline.net.messages import PROTOCOL_VERSION, Assign, Descriptor, Loading, Message, Ready
from seamline.net.tls import GroupTls
from seamline.quant import matmul
from seamline.runtime.group_stage import LockstepStage
from seamline.runtime.kv_budget import kv_budget_bytes
from seamline.runtime.stage_worker import StageWorker

log = logging.getLogger("seamline.node")
LOADING_REPORT_S = 1.0  # a download's progress goes to the coordinator this often


class NoRoom(MemoryError):
    """An assignment larger than this node's memory: ``room`` is what it has."""

    def __init__(self, message: str, room: int) -> None:
        super().__init__(message)
        self.room = room


def check_room(assign: Assign, max_memory_bytes: int | None) -> None:
    """Refuse an assignment this node cannot hold, before downloading anything."""
    room = psutil.virtual_memory().available + psutil.Process().memory_info().rss
    if max_memory_bytes is not None:
        room = min(room, max_memory_bytes)
    if assign.memory_bytes > room:
        raise NoRoom(
            f"cannot hold layers [{assign.layers[0]},{assign.layers[1]}): they need "
            f"{assign.memory_bytes / 2**30:.2f} GiB, this node has {room / 2**30:.2f} GiB",
            room,
        )


def group_tls(credentials: Credentials | None, assign: Assign) -> GroupTls | None:
    """A lockstep group's TLS over its own TCP mesh; None for a plaintext mesh or torch's."""
    creds = credentials
    if creds is None or creds.server is None or creds.client is None or assign.transport != "tcp":
        return None
    return GroupTls(creds.server, creds.client, tuple(assign.group_nodes))


def loading_reporter(assign: Assign, send: Callable[[Message], None]) -> Callable[[int, int], None]:
    """Tells the coordinator how far the download has come, a second apart at most (the console shows it)."""
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= LOADING_REPORT_S or done >= total:
            last[0] = now
            send(Loading(plan_id=assign.plan_id, bytes_done=done, bytes_total=total))

    return report


def stage_worker(
    stage: Stage | LockstepStage, assign: Assign, device: torch.device | None = None
) -> StageWorker:
    """The worker that serves ``stage``; stage 0's admits requests into a KV budget on
    ``device`` (its GPU, where it computes on one)."""
    return StageWorker(
        stage,
        assign.owns_embedding,
        assign.owns_head,
        assign.context_length,
        _kv_budget(assign, device),
    )


def _kv_budget(assign: Assign, device: torch.device | None = None) -> int | None:
    """Stage 0 admits requests into a KV budget (on its GPU, where it computes on one); later
    stages follow what it admits."""
    return kv_budget_bytes(assign.kv_cache_bytes, device) if assign.owns_embedding else None


def ready_report(assign: Assign, node_id: str, fetched: FetchReport) -> Ready:
    """READY: the loaded stage's admission descriptor, what it fetched, what the node holds."""
    descriptor = Descriptor(
        node_id=node_id,
        plan_id=assign.plan_id,
        model_hash=assign.model_hash,
        layers=assign.layers,
        dtype=assign.dtype,
        protocol_version=PROTOCOL_VERSION,
        int8_activations=matmul.INT8_ACTIVATIONS,
        shard=assign.shard,
        tail=assign.tail,
    )
    resident = (
        psutil.Process().memory_info().rss
    )  # and what its GPU holds, where it computes on one
    resident += torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0
    return Ready(
        descriptor=descriptor,
        bytes_downloaded=fetched.bytes_downloaded,
        bytes_from_peers=fetched.bytes_from_peers,
        resident_bytes=resident,
    )
