"""Resident bytes of a weight from its stored type and shape (no torch: the planner uses it)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QUANT_TYPE_NAMES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# DeepSeek's low-bit weights (quant/scaled.py): the value, and its share of a float32 scale
# (fp8: one per 128 x 128 block, as V4 stores them; fp4: one per 32 weights of a row)
SCALED_BYTES = {"float8_e4m3": 1 + 4 / (128 * 128), "float4_e2m1": 0.5 + 4 / 32}


def row_bytes(qtype: GGMLQuantizationType, cols: int) -> int:
    """Bytes of one row of ``cols`` weights of a GGML type (whole blocks)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return cols // block * size


def resident_bytes(shape: Sequence[int], stored: str, dtype_bytes: int) -> int:
    """Bytes a loaded weight takes: GGUF blocks for a quant type; for a float type, ``dtype_bytes``
    per element, except that a matrix stored narrower keeps its width (the loader's rule)."""
    if stored in QUANT_TYPE_NAMES:
        return math.prod(shape[:-1]) * row_bytes(GGMLQuantizationType[stored], shape[-1])
    if stored in SCALED_BYTES:
        return math.ceil(math.prod(shape) * SCALED_BYTES[stored])
    width = FLOAT_BYTES.get(stored, dtype_bytes)
    return math.prod(shape) * (min(width, dtype_bytes) if len(shape) >= 2 else dtype_bytes)


def block_bytes(stored: str) -> int:
    """Bytes of one block of a quant type; 0 for a float type (nothing to cut)."""
    if stored not in QUANT_TYPE_NAMES:
        return 0
    return GGML_QUANT_SIZES[GGMLQuantizationType[stored]][1]
