"""Resident bytes of a weight from its stored type and shape (no torch: the planner uses it)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QUANT_TYPE_NAMES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def row_bytes(qtype: GGMLQuantizationType, cols: int) -> int:
    """Bytes of one row of ``cols`` weights of a GGML type (whole blocks)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return cols // block * size


def resident_bytes(shape: Sequence[int], stored: str, dtype_bytes: int) -> int:
    """Bytes a loaded weight takes: GGUF blocks for a quant type; for a float type, ``dtype_bytes``
    per element, except that a matrix stored narrower keeps its width (the loader's rule)."""
    if stored in QUANT_TYPE_NAMES:
        return math.prod(shape[:-1]) * row_bytes(GGMLQuantizationType[stored], shape[-1])
    width = FLOAT_BYTES.get(stored, dtype_bytes)
    return math.prod(shape) * (min(width, dtype_bytes) if len(shape) >= 2 else dtype_bytes)


def block_bytes(stored: str) -> int:
    """Bytes of one block of a quant type; 0 for a float type (nothing to cut)."""
    if stored not in QUANT_TYPE_NAMES:
        return 0
    return GGML_QUANT_SIZES[GGMLQuantizationType[stored]][1]
