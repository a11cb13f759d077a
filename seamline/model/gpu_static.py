"""A GPU decode step as a captured graph needs its attention rows from a fixed device table: which
positions and whose caches, refilled before each replay (``runtime/cuda_graphs.py``). This module
holds that table while a step is captured; Triton is imported only when a table is in use."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_STATIC: list[
    dict[int, torch.Tensor]
] = []  # while a decode step is captured: layer -> its rows' table


@contextmanager
def static_tables(tables: dict[int, torch.Tensor]) -> Iterator[None]:
    """Within: every GPU attention layer reads its rows from ``tables[layer]`` ([4, rows] int64:
    position, keys' address, values' address, capacity) instead of building one from the spans."""
    _STATIC.append(tables)
    try:
        yield
    finally:
        _STATIC.pop()


def static_table(layer: int) -> torch.Tensor | None:
    return _STATIC[-1].get(layer) if _STATIC else None


def attend_with_table(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    table: torch.Tensor,
    heads: int,
    kv_heads: int,
    dim: int,
    window: int = 0,
) -> torch.Tensor:
    from seamline.model import gpu_attention

    return gpu_attention.attend_with_table(qkv, cos, sin, table, heads, kv_heads, dim, window)
