"""Quantise float32 matrices into GGUF blocks (tests and benchmarks write GGUF files with it).

``quantize(x [rows, cols], qtype) -> uint8 [rows, row_bytes]`` for the float types, the
32-wide legacy types (gguf-py's own quantisers) and the 256-wide K types Q4_K, Q5_K, Q6_K,
which gguf-py can only decode. The K quantisers are a plain per-sub-block min/max scheme
(no importance search as llama.cpp's): every sub-block's scale is rounded *up* to its 6- or
8-bit code so that no value clips, so a value's error is at most about half a step of its
own sub-block plus the rounding of the block's shared super-scale. Work is done in chunks
of rows so that a large matrix needs only a few times its chunk's size in temporaries.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize

from seamline.quant.sizes import row_bytes
from seamline.quant.tensor import K_TYPES

QK_K = 256
CHUNK_VALUES = 1 << 22  # values quantised per numpy pass (~16 MB of float32)

FLOAT_TYPES: frozenset[Q] = frozenset({Q.F32, Q.F16, Q.BF16})
GGUF_PY_TYPES: frozenset[Q] = frozenset({Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4})
QUANTIZABLE: frozenset[Q] = FLOAT_TYPES | GGUF_PY_TYPES | K_TYPES


def quantize(x: np.ndarray, qtype: Q) -> np.ndarray:
    """float [rows, cols] -> uint8 [rows, row_bytes(qtype, cols)] in GGUF block layout."""
    qtype = Q(qtype)
    if qtype not in QUANTIZABLE:
        names = ", ".join(sorted(t.name for t in QUANTIZABLE))
        raise ValueError(f"cannot quantise to {qtype.name}; quantise() writes {names}")
    if x.ndim != 2:
        raise ValueError(f"quantize takes a 2-D matrix, got shape {x.shape}")
    rows, cols = x.shape
    block = GGML_QUANT_SIZES[qtype][0]
    if cols % block:
        raise ValueError(f"{qtype.name} needs rows of whole {block}-value blocks; a row has {cols}")
    out = np.empty((rows, row_bytes(qtype, cols)), dtype=np.uint8)
    step = max(1, CHUNK_VALUES // max(cols, 1))
    for start in range(0, rows, step):
        part = np.asarray(x[start : start + step], dtype=np.float32)
        out[start : start + step] = _quantize_rows(part, qtype).reshape(part.shape[0], -1)
    return out


def _quantize_rows(x: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return np.ascontiguousarray(x).view(np.uint8)
    if qtype == Q.F16:
        return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8)
    if qtype in GGUF_PY_TYPES:
        return np.asarray(gguf_quantize(x, qtype)).view(np.uint8)
    blocks = x.reshape(-1, QK_K)
    if qtype == Q.Q6_K:
        return _q6_k(blocks)
    return _qx_k(blocks, 5 if qtype == Q.Q5_K else 4)


def _f16_up(v: np.ndarray) -> np.ndarray:
    """float16 values no smaller than ``v`` (v >= 0), so scales derived from them never clip."""
    h = v.astype(np.float16)
    low = h.astype(np.float32) < v
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _scale_codes(want: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-sub-block scales ``want`` [nb, S] >= 0 -> (float16 super-scale [nb, 1], codes [nb, S]),
    codes rounded up so that super * code >= want."""
    top = want.max(axis=1, keepdims=True)
    d = _f16_up(top / levels)
    dd = d.astype(np.float32)
    codes = np.ceil(np.divide(want, dd, out=np.zeros_like(want), where=dd > 0) - 1e-6)
    return d, np.clip(codes, 0, levels).astype(np.uint8)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [nb, 8] -> the 12-byte layout of Q4_K / Q5_K."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _qx_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits=4) or Q5_K (bits=5): x ~ d*sc[s]*q - dmin*m[s] over 8 sub-blocks of 32."""
    nb = blocks.shape[0]
    top_q = (1 << bits) - 1
    x = blocks.reshape(nb, 8, 32)
    neg_min = -np.minimum(x.min(axis=2), 0.0)  # [nb, 8] >= 0: the offset each sub-block needs
    dmin_top = neg_min.max(axis=1, keepdims=True)
    dmin = (dmin_top / 63).astype(np.float16)
    dm = dmin.astype(np.float32)
    m = np.clip(np.rint(np.divide(neg_min, dm, out=np.zeros_like(neg_min), where=dm > 0)), 0, 63)
    offset = m * dm  # [nb, 8], what dequantisation subtracts
    spread = np.maximum(x.max(axis=2) + offset, 0.0) / top_q
    d, sc = _scale_codes(spread, 63)
    step = d.astype(np.float32) * sc  # [nb, 8]
    shifted = x + offset[:, :, None]
    q = np.divide(shifted, step[:, :, None], out=np.zeros_like(shifted), where=step[:, :, None] > 0)
    q = np.clip(np.rint(q), 0, top_q).astype(np.uint8)  # [nb, 8, 32]
    head = np.concatenate(
        [d.view(np.uint8), dmin.view(np.uint8), _pack_k_scales(sc, m.astype(np.uint8))], axis=1
    )
    # qs: chunk j of 32 bytes holds sub-block 2j in the low nibbles, 2j+1 in the high ones
    qs = ((q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)).reshape(nb, 128)
    if bits == 4:
        return np.concatenate([head, qs], axis=1)
    # qh[l]: bit s is the fifth bit of sub-block s's value l
    fifth = (q >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(fifth, axis=1)  # [nb, 32]
    return np.concatenate([head, qh, qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: x ~ d*sc[s]*(q-32) over 16 sub-blocks of 16, signed 8-bit sc."""
    nb = blocks.shape[0]
    x = blocks.reshape(nb, 16, 16)
    d, sc = _scale_codes(np.abs(x).max(axis=2) / 31, 127)
    step = d.astype(np.float32) * sc  # [nb, 16]
    q = np.divide(x, step[:, :, None], out=np.zeros_like(x), where=step[:, :, None] > 0)
    u = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)
    # per 128-value half: rows r=0..3 are values r*32 + l
    low, high = u & 0xF, u >> 4
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2
    ).reshape(nb, 128)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate(
        [ql, qh.reshape(nb, 64), sc.astype(np.int8).view(np.uint8), d.view(np.uint8)], axis=1
    )
