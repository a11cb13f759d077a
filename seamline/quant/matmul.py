"""quant_linear: x @ W.T for a QuantTensor W, without ever holding W in float for a decode step.

On CPU with the C++ kernels (``native.kernels()``), up to ``DECODE_ROWS`` activation rows go
through the fused kernel: the activations are rounded to int8 blocks of 32 (as llama.cpp does)
and multiplied with the GGUF blocks as they lie. More rows (prefill) dequantise W to bfloat16
in tiles and use torch's bf16 GEMM (oneDNN, AMX where present): activations and the GEMM output
are then rounded to bfloat16. Elsewhere (CUDA, no kernels): dequantise, then F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from seamline.quant.dequant import dequantize
from seamline.quant.native import kernels
from seamline.quant.tensor import QuantTensor

DECODE_ROWS = 16  # up to this many rows the fused kernel beats dequantise + GEMM (measured)
TILE_ELEMENTS = 1 << 22  # weights dequantised per prefill tile: 8 MB of bfloat16
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _prefill(ops, x: torch.Tensor, data: torch.Tensor, qtype: int, rows: int, cols: int) -> torch.Tensor:
    """x [M, cols] -> [M, rows] in bf16: dequantise row tiles of W to bf16, GEMM each tile."""
    xb = x.to(torch.bfloat16)
    tile = max(64, TILE_ELEMENTS // cols)
    if rows <= tile:
        return F.linear(xb, ops.dequant_bf16(data, qtype, cols))
    out = torch.empty(x.shape[0], rows, dtype=torch.bfloat16)
    for start in range(0, rows, tile):
        end = min(rows, start + tile)
        out[:, start:end] = F.linear(xb, ops.dequant_bf16(data[start:end], qtype, cols))
    return out


def quant_linear(
    x: torch.Tensor, w: QuantTensor, bias: torch.Tensor | None = None, *, use_kernels: bool = True
) -> torch.Tensor:
    """x [..., cols] -> [..., rows] in x.dtype, for a 2-D ``w`` [rows, cols]; ``use_kernels=False``
    forces the torch path (dequantise, F.linear)."""
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"quant_linear needs x [..., {w.shape[-1]}] and a 2-D weight, got {tuple(x.shape)} x {w.shape}")
    rows, cols = w.shape
    ops = kernels() if use_kernels and x.device.type == "cpu" and w.data.device.type == "cpu" else None
    if ops is None or x.dtype not in _KERNEL_DTYPES:
        return F.linear(x, dequantize(w, x.dtype), None if bias is None else bias.to(x.dtype))
    x2 = x.reshape(-1, cols)  # [M, cols]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    data = w.data if w.data.stride(-1) == 1 else w.data.contiguous()
    if x2.shape[0] <= DECODE_ROWS:
        y = ops.qmatmul(x2, data, int(w.qtype), cols, bias)
    else:
        y = _prefill(ops, x2, data, int(w.qtype), rows, cols).to(x.dtype)
        if bias is not None:
            y = y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], rows)
