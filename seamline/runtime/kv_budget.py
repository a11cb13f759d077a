"""The KV cache budget a server's scheduler admits requests into (``--kv-cache-memory``)."""

from __future__ import annotations

import psutil

KV_SHARE_OF_FREE_MEMORY = 0.8  # the default KV budget: this much of the memory free at start


def kv_budget_bytes(requested: int = 0) -> int:
    """The KV cache budget: ``requested`` bytes, or (0) most of the memory free now."""
    return requested if requested > 0 else int(psutil.virtual_memory().available * KV_SHARE_OF_FREE_MEMORY)
