"""quant_linear: x @ W.T for a QuantTensor W, without ever holding W in float for a decode step.

On CPU with the C++ kernels (``native.kernels()``) one torch op does everything: up to
``DECODE_ROWS`` activation rows go through the fused kernel (activations rounded to int8 blocks
of 32, or 256 for K-quants, as llama.cpp does; GGUF blocks read as they lie); more rows
(prefill) dequantise W to bfloat16 in ~8 MB row tiles and use torch's bf16 GEMM (oneDNN, AMX
where present), rounding activations and the GEMM output to bfloat16.
Elsewhere (CUDA, no kernels, ``use_kernels=False``): dequantise, then F.linear.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from seamline.quant.dequant import dequantize
from seamline.quant.native import kernels
from seamline.quant.tensor import QuantTensor

DECODE_ROWS = 12  # up to this many rows the fused kernel beats dequantise + GEMM (measured, 2 threads)
_KERNEL_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))


_OP: list[Callable[..., torch.Tensor] | None] = []  # the kernel op (or None), resolved on first use


def _kernel_op() -> Callable[..., torch.Tensor] | None:
    if not _OP:  # a plain list, not a cache wrapper, so that torch.compile traces through
        ops = kernels()
        _OP.append(None if ops is None else ops.linear.default)
    return _OP[0]


def quant_linear(
    x: torch.Tensor, w: QuantTensor, bias: torch.Tensor | None = None, *, use_kernels: bool = True
) -> torch.Tensor:
    """x [..., cols] -> [..., rows] in x.dtype, for a 2-D ``w`` [rows, cols]; ``use_kernels=False``
    forces the torch path (dequantise, F.linear)."""
    if use_kernels and x.is_cpu and x.dtype in _KERNEL_DTYPES:
        op = _kernel_op()
        if op is not None:  # the op checks shapes, device and type itself (ValueError)
            return op(x, w.data, w.qtype, w.shape[-1], bias, DECODE_ROWS)
    if len(w.shape) != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"quant_linear needs x [..., {w.shape[-1]}] and a 2-D weight, got {tuple(x.shape)} x {w.shape}")
    return F.linear(x, dequantize(w, x.dtype), None if bias is None else bias.to(x.dtype))
