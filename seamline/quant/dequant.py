"""Dequantise GGUF blocks in plain torch (any device): the CUDA path, the fallback path, embeddings.

Every decoder follows gguf-py's numpy dequantiser operation by operation, so float32 results are
bit-identical to ``gguf.quants.dequantize``; other dtypes are that result rounded once. On CPU,
where the C++ kernels load, they do the same arithmetic ~100x faster (same bits; tested).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from seamline.quant.native import kernels
from seamline.quant.tensor import QuantTensor


def _half(b: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 2] little-endian fp16 fields -> float32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 16] -> [n, 32]: the low nibbles are elements 0..15, the high ones 16..31."""
    qs = qs.contiguous()  # a strided slice of the blocks: bit operations on it run ~5x slower
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 4] (a little-endian uint32) -> uint8 [n, 32]: bit j of the word as element j."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _half(b[:, 0:2])
    return _nibbles(b[:, 2:18]).view(torch.int8).sub_(8).float().mul_(d)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _half(b[:, 0:2]), _half(b[:, 2:4])
    return _nibbles(b[:, 4:20]).float().mul_(d).add_(m)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _half(b[:, 0:2])
    q = _nibbles(b[:, 6:22]).bitwise_or_(_bits32(b[:, 2:6]) << 4)
    return q.view(torch.int8).sub_(16).float().mul_(d)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _half(b[:, 0:2]), _half(b[:, 2:4])
    q = _nibbles(b[:, 8:24]).bitwise_or_(_bits32(b[:, 4:8]) << 4)
    return q.float().mul_(d).add_(m)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:34].contiguous().view(torch.int8).float().mul_(_half(b[:, 0:2]))


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K-quant 6-bit sub-block scales and mins packed in 12 bytes -> two uint8 [n, 8]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_low(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K low nibbles [n, 128] -> [n, 8, 32]: each 32 bytes hold sub-blocks 2j (low), 2j+1 (high)."""
    q = qs.reshape(qs.shape[0], 4, 32)  # a strided slice of the blocks: copied once here, not twice
    return torch.stack([q & 0x0F, q >> 4], dim=2).reshape(qs.shape[0], 8, 32)


def _k_scaled(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """d * sc * q - dmin * m per sub-block of 32, as gguf-py orders it."""
    n = b.shape[0]
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    ds = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    return q.float().mul_(ds).sub_(dm).reshape(n, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_scaled(b, _k_low(b[:, 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8).reshape(1, 8, 1)
    qh = (b[:, 16:48].reshape(n, 1, 32) >> shifts) & 1  # [n, 8 sub-blocks, 32]
    return _k_scaled(b, _k_low(b[:, 48:176]) | (qh << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dev = b.device
    # shifts made on the device (arange): no copy from the host, so a CUDA graph can hold this
    ql = b[:, 0:128].reshape(n, 2, 1, 64) >> torch.arange(
        0, 8, 4, device=dev, dtype=torch.uint8
    ).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> torch.arange(
        0, 8, 2, device=dev, dtype=torch.uint8
    ).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(n, 8, 32)
    q = ql.bitwise_or_(qh << 4).view(torch.int8).sub_(32).reshape(n, 16, 16).float()
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_half(b[:, 208:210]) * scales).reshape(n, 16, 1)
    return q.mul_(d).reshape(n, 256)


_DECODERS: dict[T, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}


def _decode(
    qtype: T, data: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, use_kernels: bool
) -> torch.Tensor:
    type_size = GGML_QUANT_SIZES[qtype][1]
    ops = kernels() if use_kernels and data.is_cpu and dtype.is_floating_point else None
    if ops is not None:
        rows = data.reshape(-1, data.shape[-1])  # [rows, row_bytes]
        if dtype == torch.bfloat16:
            return ops.dequant_bf16(rows, qtype, shape[-1]).reshape(shape)
        return ops.dequant_f32(rows, qtype, shape[-1]).reshape(shape).to(dtype)
    blocks = data.contiguous().reshape(-1, type_size)  # [n_blocks, type_size]
    return _DECODERS[qtype](blocks).reshape(shape).to(dtype)


def dequantize(
    w: QuantTensor, dtype: torch.dtype = torch.float32, *, use_kernels: bool = True
) -> torch.Tensor:
    """The float weight [*lead, rows, cols] that ``w``'s blocks encode, on ``w``'s device;
    ``use_kernels=False`` forces the torch decoders."""
    if w.qtype not in _DECODERS:
        raise NotImplementedError(f"no dequantiser for {w.qtype.name}")
    return _decode(w.qtype, w.data, w.shape, dtype, use_kernels)


def dequantize_rows(
    w: QuantTensor,
    ids: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    use_kernels: bool = True,
) -> torch.Tensor:
    """Rows ``ids`` of the 2-D weight ``w`` (an embedding lookup): [*ids.shape, cols], only those rows decoded."""
    if w.dim() != 2:
        raise ValueError(f"dequantize_rows needs a 2-D weight, got shape {w.shape}")
    picked = w.data.index_select(0, ids.reshape(-1).to(w.device))  # [n_ids, row_bytes]
    return _decode(w.qtype, picked, (*ids.shape, w.shape[1]), dtype, use_kernels)
