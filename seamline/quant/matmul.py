"""quant_linear: x @ W.T for a QuantTensor W, without ever holding W in float for a decode step.

On CPU with the C++ kernels (``native.kernels()``), by ``SEAMLINE_QUANT_ACTIVATIONS``:

* ``exact`` (default): up to ``DECODE_ROWS`` activation rows, every weight is decoded in
  registers as gguf-py decodes it and multiplied in float32 (``linear_exact``): the answers of
  the dequantised weights. More rows (prefill): float32 activations multiply the dequantised
  float32 matrix; bfloat16 ones dequantised bfloat16 tiles with torch's bf16 GEMM (oneDNN).
* ``int8``: as llama.cpp does, activations rounded to int8 blocks of 32 (256 for K-quants) and
  multiplied with the blocks by VNNI integer dot products: about 2x faster on big matrices,
  at the cost of that rounding. Many rows (batched steps, prefill): on a CPU with AMX-INT8, the
  32-wide block types go through AMX tiles from ``AMX_FROM_ROWS`` rows (3-4x the AVX-512
  kernel at 16-64 rows; ``SEAMLINE_QUANT_AMX=0`` turns it off); otherwise above
  ``DECODE_ROWS`` rows as prefill above, on bfloat16 tiles.

Elsewhere (CUDA, no kernels, ``use_kernels=False``): dequantise, then F.linear.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from seamline.quant.dequant import dequantize
from seamline.quant.native import kernels
from seamline.quant.tensor import QuantTensor

DECODE_ROWS = 12  # up to this many rows the fused kernel beats dequantise + GEMM (measured, 2 threads)
AMX_FROM_ROWS = 9  # int8 mode, a CPU with AMX-INT8: from this many rows tiles beat the AVX-512 kernel
AMX_ENV = "SEAMLINE_QUANT_AMX"  # "0": never AMX tiles
_KERNEL_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))


_OP: list[Callable[..., torch.Tensor] | None] = []  # the kernel op (or None), resolved on first use
_EXACT: list[Callable[..., torch.Tensor] | None] = []  # the exact (float32) decode op
# "int8": activations rounded to int8 blocks for every matmul, as llama.cpp does (the fastest);
# "exact" (default): decode in float32 on the blocks as gguf-py decodes them, prefill on
# dequantised tiles (float32 activations: float32 weights; bfloat16: bfloat16 weights and GEMM)
ACTIVATIONS_ENV = "SEAMLINE_QUANT_ACTIVATIONS"
INT8_ACTIVATIONS = os.environ.get(ACTIVATIONS_ENV, "exact") == "int8"
_AMX_FROM = 0 if os.environ.get(AMX_ENV) == "0" else AMX_FROM_ROWS  # the op checks the CPU itself


def _kernel_op() -> Callable[..., torch.Tensor] | None:
    if not _OP:  # a plain list, not a cache wrapper, so that torch.compile traces through
        ops = kernels()
        _OP.append(None if ops is None else ops.linear.default)
    return _OP[0]


def _exact_op() -> Callable[..., torch.Tensor] | None:
    if not _EXACT:
        ops = kernels()
        _EXACT.append(None if ops is None else ops.linear_exact.default)
    return _EXACT[0]


def quant_linear(
    x: torch.Tensor, w: QuantTensor, bias: torch.Tensor | None = None, *, use_kernels: bool = True
) -> torch.Tensor:
    """x [..., cols] -> [..., rows] in x.dtype, for a 2-D ``w`` [rows, cols]; ``use_kernels=False``
    forces the torch path (dequantise, F.linear)."""
    if use_kernels and x.is_cpu and x.dtype in _KERNEL_DTYPES:
        if INT8_ACTIVATIONS:
            op = _kernel_op()
            if op is not None:  # the op checks shapes, device and type itself (ValueError)
                return op(x, w.data, w.qtype, w.shape[-1], bias, DECODE_ROWS, _AMX_FROM)
        elif x.numel() <= DECODE_ROWS * x.shape[-1] and (exact := _exact_op()) is not None:
            return exact(x.reshape(-1, x.shape[-1]), w.data, w.qtype, w.shape[-1], bias).to(x.dtype).view(*x.shape[:-1], w.shape[0])
        elif x.dtype != torch.float32 and (op := _kernel_op()) is not None:
            return op(x, w.data, w.qtype, w.shape[-1], bias, 0)  # prefill: dequantised bf16 tiles, bf16 GEMM
    if len(w.shape) != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"quant_linear needs x [..., {w.shape[-1]}] and a 2-D weight, got {tuple(x.shape)} x {w.shape}")
    weight = dequantize(w, x.dtype, use_kernels=use_kernels)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
