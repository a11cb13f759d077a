"""Triton decoders of GGUF blocks: ``decode_group`` gives the float32 values of one group of 32
columns (a whole Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 block, an eighth of a K-quant super-block) for a tile
of weight rows, in registers. Each follows gguf-py's dequantiser (as ``quant/dequant.py`` does in
torch) operation by operation, so the float32 values are the same."""

from __future__ import annotations

import triton
import triton.language as tl

# GGMLQuantizationType values, as constexpr branches (a kernel reads only constexpr globals)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (
    tl.constexpr(2),
    tl.constexpr(3),
    tl.constexpr(6),
    tl.constexpr(7),
    tl.constexpr(8),
)
Q4_K, Q5_K, Q6_K = tl.constexpr(12), tl.constexpr(13), tl.constexpr(14)


@triton.jit
def _half(ptr):
    """A little-endian float16 at ``ptr`` (any shape of pointers) as float32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(base, j):
    """Elements 0..15 of a 32-block are the low nibbles of its 16 bytes, 16..31 the high ones."""
    byte = tl.load(base + (j % 16)[None, :]).to(tl.int32)
    return tl.where((j < 16)[None, :], byte & 15, byte >> 4)


@triton.jit
def _high_bit(base, j):
    """Bit j of the little-endian uint32 at ``base``: a Q5 block's fifth bit of element j."""
    return (tl.load(base + (j // 8)[None, :]).to(tl.int32) >> (j % 8)[None, :]) & 1


@triton.jit
def _scale_min(base, s):
    """Q4_K / Q5_K: sub-block ``s``'s 6-bit scale and min from the 12 packed bytes at ``base``."""
    here = tl.load(base + s).to(tl.int32)  # byte s
    later = tl.load(base + s + 4).to(tl.int32)  # byte s + 4
    earlier = tl.load(base + tl.maximum(s - 4, 0)).to(tl.int32)  # byte s - 4 (read for s >= 4 only)
    scale = tl.where(s < 4, here & 63, (later & 15) | ((earlier >> 6) << 4))
    low = tl.where(s < 4, later & 63, (later >> 4) | ((here >> 6) << 4))
    return scale.to(tl.float32), low.to(tl.float32)


@triton.jit
def decode_group(w_ptr, rows, row_bytes, g, QTYPE: tl.constexpr):
    """Values [len(rows), 32] of column group ``g`` (columns 32g .. 32g+31) of weight ``rows``."""
    j = tl.arange(0, 32)
    row = w_ptr + rows.to(tl.int64)[:, None] * row_bytes
    if QTYPE == Q8_0:
        base = row + g * 34
        q = tl.load(base + 2 + j[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
        return q * _half(base)
    elif QTYPE == Q4_0:
        base = row + g * 18
        return _half(base) * (_nibble(base + 2, j) - 8).to(tl.float32)
    elif QTYPE == Q4_1:
        base = row + g * 20
        return _half(base) * _nibble(base + 4, j).to(tl.float32) + _half(base + 2)
    elif QTYPE == Q5_0:
        base = row + g * 22
        q = _nibble(base + 6, j) | (_high_bit(base + 2, j) << 4)
        return _half(base) * (q - 16).to(tl.float32)
    elif QTYPE == Q5_1:
        base = row + g * 24
        q = _nibble(base + 8, j) | (_high_bit(base + 4, j) << 4)
        return _half(base) * q.to(tl.float32) + _half(base + 2)
    elif QTYPE == Q6_K:
        return _q6_k(row, g, j)
    else:
        return _q45_k(row, g, j, QTYPE)


@triton.jit
def _q45_k(row, g, j, QTYPE: tl.constexpr):
    """Q4_K (144-byte super-blocks) and Q5_K (176): d * scale * q - dmin * min per sub-block."""
    s = g % 8
    base = row + (g // 8) * (144 if QTYPE == Q4_K else 176)
    scale, low = _scale_min(base + 4, s)
    qs = base + (16 if QTYPE == Q4_K else 48) + (s // 2) * 32
    byte = tl.load(qs + j[None, :]).to(tl.int32)
    q = tl.where(s % 2 == 0, byte & 15, byte >> 4)
    if QTYPE == Q5_K:
        q = q | (((tl.load(base + 16 + j[None, :]).to(tl.int32) >> s) & 1) << 4)
    return (_half(base) * scale) * q.to(tl.float32) - _half(base + 2) * low


@triton.jit
def _q6_k(row, g, j):
    """Q6_K (210-byte super-blocks): 4 low bits in ql, 2 high bits in qh, an int8 scale per 16."""
    s = g % 8
    base = row + (g // 8) * 210
    half, quarter = s // 4, s % 4
    low = (
        tl.load(base + half * 64 + (quarter % 2) * 32 + j[None, :]).to(tl.int32)
        >> ((quarter // 2) * 4)
    ) & 15
    high = (tl.load(base + 128 + half * 32 + j[None, :]).to(tl.int32) >> (2 * quarter)) & 3
    q = (low | (high << 4)) - 32
    scale = (
        tl.load(base + 192 + s * 2 + (j // 16)[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
    )
    return (_half(base + 208) * scale) * q.to(tl.float32)


__all__ = ["decode_group", "triton"]
