"""The small steps of a layer as single C++ ops where the kernels are built (``quant/kernels/
decode.cpp``), else as eager torch: at one token their dispatch, not the arithmetic, sets the
speed (and torch's bfloat16 rms_norm alone took ~30 us for 576 values here).

Every function takes what its torch form takes and gives the same answer up to rounding: the C++
forms compute in float32 and round once to the activations' dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from seamline.model.gpu_ops import FLOAT_DTYPES as _DTYPES  # one list for both devices
from seamline.quant.native import kernels


def op_for(x: torch.Tensor, name: str) -> Callable[..., Any] | None:
    """The C++ op ``name`` when it can take ``x`` (CPU, a float dtype, contiguous), its Triton
    form on a GPU (``model/gpu_ops.py``) where there is one, else None."""
    if x.is_cuda:
        from seamline.model.gpu_ops import op_for as gpu_op_for

        return gpu_op_for(x, name)
    if not (x.is_cpu and x.dtype in _DTYPES and x.is_contiguous()):
        return None
    ops = kernels()  # cached: loaded once per process
    return None if ops is None else getattr(ops, name).default


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    op = op_for(x, "rms_norm")
    if op is not None and weight.is_contiguous():
        return op(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): a residual add and the norm after it."""
    op = op_for(x, "add_rms_norm")
    if (
        op is not None
        and delta.is_contiguous()
        and delta.dtype == x.dtype
        and weight.is_contiguous()
    ):
        return op(x, delta, weight, eps)
    total = x + delta
    return total, F.rms_norm(total, (x.shape[-1],), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., gate | up]."""
    op = op_for(gate_up, "silu_mul")
    if op is not None:
        return op(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
