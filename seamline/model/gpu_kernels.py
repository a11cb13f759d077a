"""Triton kernels of ``model/gpu_ops.py``: one program per row, float32 inside."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    at = tl.arange(0, BLOCK)
    keep = at < cols
    x = tl.load(x_ptr + row * cols + at, mask=keep, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + at, mask=keep, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / cols + eps)
    tl.store(out_ptr + row * cols + at, (x * scale * w).to(out_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    at = tl.arange(0, BLOCK)
    keep = at < cols
    x = tl.load(x_ptr + row * cols + at, mask=keep, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * cols + at, mask=keep, other=0.0).to(tl.float32)
    total = (x + d).to(sum_ptr.dtype.element_ty)  # the residual stream keeps its dtype's rounding
    tl.store(sum_ptr + row * cols + at, total, mask=keep)
    f = total.to(tl.float32)
    w = tl.load(w_ptr + at, mask=keep, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(f * f, axis=0) / cols + eps)
    tl.store(out_ptr + row * cols + at, (f * scale * w).to(out_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    at = part * BLOCK + tl.arange(0, BLOCK)
    keep = at < inter
    gate = tl.load(gu_ptr + row * 2 * inter + at, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * 2 * inter + inter + at, mask=keep, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + at, out.to(out_ptr.dtype.element_ty), mask=keep)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.numel() else 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    cols = x.shape[-1]
    if _rows(x):
        _rms_norm_kernel[(_rows(x),)](x, weight, out, cols, eps, BLOCK=triton.next_power_of_2(cols))
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total, out = torch.empty_like(x), torch.empty_like(x)
    cols = x.shape[-1]
    if _rows(x):
        _add_rms_norm_kernel[(_rows(x),)](
            x, delta.contiguous(), weight, total, out, cols, eps, BLOCK=triton.next_power_of_2(cols)
        )
    return total, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    block = min(1024, triton.next_power_of_2(inter))
    if _rows(gate_up):
        _silu_mul_kernel[(_rows(gate_up), triton.cdiv(inter, block))](
            gate_up, out, inter, BLOCK=block
        )
    return out
