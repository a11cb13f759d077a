"""A checked stage shows the coordinator the input rows it computed on (``mesh.control.verify``
asks the one stage it checks of a followed request, after the stage reported their digests)."""

from __future__ import annotations

import torch

from seamline.net.byte_parts import PART_BYTES, split
from seamline.net.messages import KeptRows, KeptRowsAsk
from seamline.runtime.stage_worker import StageWorker


def kept_rows(worker: StageWorker, ask: KeptRowsAsk, plan_id: int) -> list[KeptRows]:
    """The answer to ``ask``: the rows' bytes in parts of at most ``PART_BYTES`` (one part
    that says ``gone`` when they are not all kept)."""
    rows = worker.kept.rows(ask.request, ask.start, ask.end) if worker.kept is not None else None
    base = {"plan_id": plan_id, "layers": ask.layers, "request": ask.request, "start": ask.start}
    if rows is None or ask.end <= ask.start:
        return [KeptRows(**base, count=0, data="", gone=True)]
    raw = rows.contiguous().view(torch.uint8).numpy().tobytes()
    return [
        KeptRows(**base, count=rows.shape[0], offset=at, data=data)
        for at, data in split(raw, PART_BYTES)
    ]
