"""Triton decoders of GGUF blocks (imported only where Triton is: see ``quant.triton_gguf``).

Each step of a kernel covers 256 values of a weight row: eight 32-wide blocks, or one 256-wide
K-quant superblock. A decoder returns that step's values as two float32 halves ``lo`` and ``hi``
of shape [rows, G, H], where ``lo[:, g, h]`` is value ``g*2H + h`` of the step and ``hi[:, g, h]``
value ``g*2H + H + h``: the halves the blocks pack into one byte's two nibbles, so that every
quant byte is loaded once and no value is gathered across registers.

Arguments of every decoder: ``p`` the uint8 blocks; ``base`` [rows, G, 1] int64 byte offset of the
block holding group ``g``; ``g`` [1, G, 1] the group within the step; ``h`` [1, 1, H]; ``mask``
[rows, G, 1]. The arithmetic follows gguf-py's numpy dequantiser operation by operation
(``quant/dequant.py`` documents the layouts), so float32 values are bit-identical to it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _byte(p, at, mask):
    return tl.load(p + at, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(p, at, mask):
    """The little-endian float16 at byte ``at``, as float32."""
    lo = tl.load(p + at, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + at + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word(p, at, mask):
    """The little-endian 32 bits at byte ``at`` (int32: only single bits are read from it)."""
    return _byte(p, at, mask) | (_byte(p, at + 1, mask) << 8) | (_byte(p, at + 2, mask) << 16) | (_byte(p, at + 3, mask) << 24)


@triton.jit
def _q4_0(p, base, g, h, mask):
    d = _half(p, base, mask)
    q = _byte(p, base + 2 + h, mask)
    return d * ((q & 15) - 8).to(tl.float32), d * ((q >> 4) - 8).to(tl.float32)


@triton.jit
def _q4_1(p, base, g, h, mask):
    d = _half(p, base, mask)
    m = _half(p, base + 2, mask)
    q = _byte(p, base + 4 + h, mask)
    return d * (q & 15).to(tl.float32) + m, d * (q >> 4).to(tl.float32) + m


@triton.jit
def _q5_0(p, base, g, h, mask):
    d = _half(p, base, mask)
    qh = _word(p, base + 2, mask)
    q = _byte(p, base + 6 + h, mask)
    lo = (q & 15) | (((qh >> h) & 1) << 4)
    hi = (q >> 4) | (((qh >> (h + 16)) & 1) << 4)
    return d * (lo - 16).to(tl.float32), d * (hi - 16).to(tl.float32)


@triton.jit
def _q5_1(p, base, g, h, mask):
    d = _half(p, base, mask)
    m = _half(p, base + 2, mask)
    qh = _word(p, base + 4, mask)
    q = _byte(p, base + 8 + h, mask)
    lo = (q & 15) | (((qh >> h) & 1) << 4)
    hi = (q >> 4) | (((qh >> (h + 16)) & 1) << 4)
    return d * lo.to(tl.float32) + m, d * hi.to(tl.float32) + m


@triton.jit
def _q8_0(p, base, g, h, mask):
    d = _half(p, base, mask)
    lo = tl.load(p + base + 2 + h, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    hi = tl.load(p + base + 18 + h, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return lo * d, hi * d


@triton.jit
def _k_scaled(p, base, s, mask):
    """(d * scale, dmin * min) of K-quant sub-block ``s`` [1, G, 1]: 6-bit fields packed in 12
    bytes S at offset 4: s < 4 reads S[s] & 63 and S[s+4] & 63; s >= 4 the nibbles of S[s+4]
    with the top two bits from S[s-4] (scale) and S[s] (min)."""
    low = s < 4
    a = _byte(p, base + 4 + s + 4, mask)
    b = _byte(p, base + 4 + s, mask)
    c = _byte(p, base + 4 + tl.where(low, s, s - 4), mask)
    sc = tl.where(low, b & 63, (a & 15) | ((c >> 2) & 48))
    mn = tl.where(low, a & 63, (a >> 4) | ((b >> 2) & 48))
    return _half(p, base, mask) * sc.to(tl.float32), _half(p, base + 2, mask) * mn.to(tl.float32)


@triton.jit
def _q4_k(p, base, g, h, mask):
    # G=4, H=32: byte j of the 32 at 16 + 32g holds sub-block 2g (low nibble) and 2g+1 (high)
    ds_lo, dm_lo = _k_scaled(p, base, 2 * g, mask)
    ds_hi, dm_hi = _k_scaled(p, base, 2 * g + 1, mask)
    q = _byte(p, base + 16 + g * 32 + h, mask)
    return ds_lo * (q & 15).to(tl.float32) - dm_lo, ds_hi * (q >> 4).to(tl.float32) - dm_hi


@triton.jit
def _q5_k(p, base, g, h, mask):
    # as Q4_K with qs at 48; bit s of qh byte j (at 16 + j) is the fifth bit of sub-block s
    ds_lo, dm_lo = _k_scaled(p, base, 2 * g, mask)
    ds_hi, dm_hi = _k_scaled(p, base, 2 * g + 1, mask)
    qh = _byte(p, base + 16 + h, mask)
    q = _byte(p, base + 48 + g * 32 + h, mask)
    lo = (q & 15) | (((qh >> (2 * g)) & 1) << 4)
    hi = (q >> 4) | (((qh >> (2 * g + 1)) & 1) << 4)
    return ds_lo * lo.to(tl.float32) - dm_lo, ds_hi * hi.to(tl.float32) - dm_hi


@triton.jit
def _q6_k(p, base, g, h, mask):
    # G=2, H=64: value 128g + 64t + h has low nibble t of ql[64g + h], two high bits at
    # 2(2t + h//32) of qh[128 + 32g + h%32], scale int8 [192 + (value // 16)], d at 208
    ql = _byte(p, base + g * 64 + h, mask)
    qh = _byte(p, base + 128 + g * 32 + (h % 32), mask)
    shift = 2 * (h // 32)
    lo = ((ql & 15) | (((qh >> shift) & 3) << 4)) - 32
    hi = ((ql >> 4) | (((qh >> (shift + 4)) & 3) << 4)) - 32
    d = _half(p, base + 208, mask)
    sc_lo = tl.load(p + base + 192 + g * 8 + h // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
    sc_hi = tl.load(p + base + 196 + g * 8 + h // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
    return (d * sc_lo.to(tl.float32)) * lo.to(tl.float32), (d * sc_hi.to(tl.float32)) * hi.to(tl.float32)


@triton.jit
def decode(p, base, g, h, mask, QTYPE: tl.constexpr):
    """One step's values (``lo``, ``hi``) of GGML type id ``QTYPE``."""
    if QTYPE == 2:
        lo, hi = _q4_0(p, base, g, h, mask)
    elif QTYPE == 3:
        lo, hi = _q4_1(p, base, g, h, mask)
    elif QTYPE == 6:
        lo, hi = _q5_0(p, base, g, h, mask)
    elif QTYPE == 7:
        lo, hi = _q5_1(p, base, g, h, mask)
    elif QTYPE == 8:
        lo, hi = _q8_0(p, base, g, h, mask)
    elif QTYPE == 12:
        lo, hi = _q4_k(p, base, g, h, mask)
    elif QTYPE == 13:
        lo, hi = _q5_k(p, base, g, h, mask)
    else:
        tl.static_assert(QTYPE == 14, "no Triton decoder for this GGML type")
        lo, hi = _q6_k(p, base, g, h, mask)
    return lo, hi


@triton.jit
def step_blocks(row_off, row_ok, step, n_blocks, g, G: tl.constexpr, BPS: tl.constexpr, TS: tl.constexpr):
    """Byte offsets [rows, G, 1] of the blocks of step ``step`` (BPS blocks of TS bytes each, G
    groups), and which exist: the last step of a row of 32-wide blocks may be partial."""
    blk = step * BPS + g // (G // BPS)  # [1, G, 1]
    base = row_off[:, None, None] + blk.to(tl.int64) * TS
    return base, row_ok[:, None, None] & (blk < n_blocks)


@triton.jit
def cast_out(v, dtype: tl.constexpr):
    """float32 ``v`` in ``dtype``, bfloat16 rounded to nearest even by its bits, as torch rounds
    (Triton's interpreter would truncate): the same bits on a GPU and in the interpreter."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = v.to(dtype)
    return out
