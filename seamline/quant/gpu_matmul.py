"""x @ W.T for GGUF-quantized W on a GPU, with Triton kernels over the blocks as the file has them.

Up to ``DECODE_ROWS`` activation rows (decode steps, small batches) ``_blocks_matmul`` reads
each weight block once, decodes it in registers (``gpu_blocks.decode_group``) and accumulates
in float32: the weight stays at its size and is read once per step, which is what a decode step
costs. More rows (prefill, large batches) dequantise row tiles of W to the activations' dtype
(``_dequantize``) and multiply them with cuBLAS, a tile (about ``TILE_BYTES``) at a time.
The fused kernel multiplies in IEEE float32 whatever the activations' dtype (no TF32): the
exact path's answers up to the order of the sums, and at most 16 rows the reads, not the
arithmetic, set its pace. Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (the tests).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from seamline.quant.gpu_blocks import decode_group, tl, triton

DECODE_ROWS = 16  # up to this many rows the fused kernel; one tl.dot tile of 16 rows
BLOCK_ROWS = 16  # weight rows per program
TILE_BYTES = 64 << 20  # the dequantised tile of the many-rows path
SUPPORTED = frozenset((T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K))


def available(x: torch.Tensor) -> bool:
    """Whether the kernels can take ``x``: on CUDA, or on the CPU in Triton's interpreter."""
    return x.is_cuda or (x.is_cpu and os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _blocks_matmul(
    x_ptr,
    w_ptr,
    out_ptr,
    bias_ptr,
    M,
    N,
    K,
    row_bytes,
    QTYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    keep = rows < N
    m = tl.arange(0, BM)
    j = tl.arange(0, 32)
    acc = tl.zeros((BM, BN), tl.float32)
    for g in range(K // 32):
        w = decode_group(w_ptr, tl.where(keep, rows, 0), row_bytes, g, QTYPE)  # [BN, 32]
        x = tl.load(x_ptr + m[:, None] * K + g * 32 + j[None, :], mask=(m < M)[:, None], other=0.0)
        acc += tl.dot(
            x.to(tl.float32), tl.trans(w), input_precision="ieee"
        )  # reads, not flops, set the pace
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=keep, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + m[:, None] * N + rows[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(m < M)[:, None] & keep[None, :],
    )


@triton.jit
def _dequantize(w_ptr, out_ptr, N, K, row_bytes, QTYPE: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    keep = rows < N
    g = tl.program_id(1)
    w = decode_group(w_ptr, tl.where(keep, rows, 0), row_bytes, g, QTYPE)
    at = rows.to(tl.int64)[:, None] * K + g * 32 + tl.arange(0, 32)[None, :]
    tl.store(out_ptr + at, w.to(out_ptr.dtype.element_ty), mask=keep[:, None])


def gguf_dequantize(
    data: torch.Tensor, qtype: T, cols: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The float weight [rows, cols] of GGUF blocks ``data`` [rows, row_bytes]."""
    rows = data.shape[0]
    out = torch.empty(rows, cols, dtype=dtype, device=data.device)
    if rows:
        grid = (triton.cdiv(rows, BLOCK_ROWS), cols // 32)
        _dequantize[grid](data, out, rows, cols, data.shape[1], QTYPE=int(qtype), BN=BLOCK_ROWS)
    return out


def gguf_linear(
    x: torch.Tensor, data: torch.Tensor, qtype: T, cols: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., cols] @ W.T (+ bias) -> [..., rows] in x's dtype, W the blocks ``data`` [rows, row_bytes]."""
    rows = data.shape[0]
    flat = x.reshape(-1, cols)
    if flat.shape[0] > DECODE_ROWS:
        return _tiled(flat, data, qtype, cols, bias).view(*x.shape[:-1], rows)
    flat = flat.contiguous()
    out = torch.empty(flat.shape[0], rows, dtype=x.dtype, device=x.device)
    if flat.shape[0]:
        _blocks_matmul[(triton.cdiv(rows, BLOCK_ROWS),)](
            flat,
            data,
            out,
            bias if bias is not None else out,
            flat.shape[0],
            rows,
            cols,
            data.shape[1],
            QTYPE=int(qtype),
            HAS_BIAS=bias is not None,
            BM=DECODE_ROWS,
            BN=BLOCK_ROWS,
        )
    return out.view(*x.shape[:-1], rows)


def _tiled(
    x: torch.Tensor, data: torch.Tensor, qtype: T, cols: int, bias: torch.Tensor | None
) -> torch.Tensor:
    rows = data.shape[0]
    tile = max(BLOCK_ROWS, TILE_BYTES // (cols * x.element_size()))
    parts = [
        F.linear(x, gguf_dequantize(data[start : start + tile], qtype, cols, x.dtype))
        for start in range(0, rows, tile)
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return out if bias is None else out + bias.to(x.dtype)
