"""The KV cache budget a server's scheduler admits requests into (``--kv-cache-memory``)."""

from __future__ import annotations

import psutil
import torch

from seamline.model.devices import free_bytes

KV_SHARE_OF_FREE_MEMORY = 0.8  # the default KV budget: this much of the memory free at start


def kv_budget_bytes(requested: int = 0, device: torch.device | None = None) -> int:
    """The KV cache budget: ``requested`` bytes, or (0) most of the memory free now: the
    GPU's, once the weights are on it, for a stage on a GPU."""
    if requested > 0:
        return requested
    on_gpu = free_bytes(device) if device is not None else None
    free = on_gpu if on_gpu is not None else psutil.virtual_memory().available
    return int(free * KV_SHARE_OF_FREE_MEMORY)
