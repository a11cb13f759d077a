"""x @ W.T for GGUF-quantized W on the GPU, in Triton: a fused kernel for a few rows, dequantised
tiles and torch's GEMM for more. Triton is no dependency on a CPU: without it this module
imports, ``available`` says False, and nothing else may be called.

* Up to ``DECODE_ROWS`` activation rows (decode, small batches): one kernel; each program takes
  ``BLOCK_N`` weight rows and all activation rows, steps along the row 256 values (one K-quant
  superblock or eight 32-wide blocks) at a time, decodes the blocks in registers (``triton_blocks``)
  and accumulates in float32. Where the weight has too few row blocks to fill the GPU, the row is
  split into ``split`` spans whose float32 partial sums torch adds (in a fixed order: the same
  answer every call).
* More rows: row tiles of W (about ``TILE_BYTES``) dequantised to x.dtype by a Triton kernel,
  each multiplied with F.linear (cuBLAS).

Off a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is
imported, and CPU tensors): slow, for tests.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

try:
    import triton
    import triton.language as tl

    from seamline.quant.triton_blocks import cast_out, decode, step_blocks
except ImportError:  # a CPU machine without Triton: ``available`` is False
    triton = None

STEP = 256  # values of a weight row per kernel step
DECODE_ROWS = 16  # up to this many activation rows: the fused kernel; beyond, tiles + GEMM
TILE_BYTES = 32 << 20  # the dequantised tile of the many-rows path
BLOCK_N = 8  # weight rows per program of the fused kernel
DEQUANT_ROWS = 16  # weight rows per program of the dequantiser
PROGRAMS_PER_SM = 4  # the fused kernel splits rows until about this many programs per SM
MIN_SPLIT_STEPS = 4  # ... keeping at least this many steps in each span

# per type: (G, H) of the decoders' halves [rows, G, H], and blocks per step
_LAYOUT: dict[T, tuple[int, int, int]] = {
    T.Q4_0: (8, 16, 8), T.Q4_1: (8, 16, 8), T.Q5_0: (8, 16, 8), T.Q5_1: (8, 16, 8), T.Q8_0: (8, 16, 8),
    T.Q4_K: (4, 32, 1), T.Q5_K: (4, 32, 1), T.Q6_K: (2, 64, 1),
}  # fmt: skip
SUPPORTED: frozenset[T] = frozenset(_LAYOUT)
_SMS: dict[int, int] = {}  # CUDA device index -> multiprocessor count


def available(x: torch.Tensor) -> bool:
    """Triton is importable and runs on ``x``'s device: CUDA, or the interpreter on a CPU."""
    if triton is None:
        return False
    return x.is_cuda or (x.is_cpu and os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, row_bytes, n_blocks, n_steps, span, stride_x,
        QTYPE: tl.constexpr, G: tl.constexpr, H: tl.constexpr, BPS: tl.constexpr, TS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
    ):  # fmt: skip
        """out[m, n] (or the float32 partial of span program_id(1): out[split, m, n]) for BLOCK_N
        weight rows n and all M <= BLOCK_M activation rows, over steps [first, first + span)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        row_off = rows.to(tl.int64) * row_bytes
        g = tl.arange(0, G)[None, :, None]
        h = tl.arange(0, H)[None, None, :]
        first = tl.program_id(1) * span
        ms = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, G, H), dtype=tl.float32)  # one row: summed once, after the loop
        for step in range(first, tl.minimum(first + span, n_steps)):
            base, mask = step_blocks(row_off, row_ok, step, n_blocks, g, G, BPS, TS)
            lo, hi = decode(w_ptr, base, g, h, mask, QTYPE)  # [BLOCK_N, G, H] float32 each
            at = step * STEP + g * (2 * H) + h  # [1, G, H]: lo's columns; hi's are at + H
            if BLOCK_M == 1:
                x_lo = tl.load(x_ptr + at, mask=at < K, other=0.0).to(tl.float32)
                x_hi = tl.load(x_ptr + at + H, mask=at + H < K, other=0.0).to(tl.float32)
                acc1 += lo * x_lo + hi * x_hi
            else:
                for m in tl.static_range(BLOCK_M):
                    k_m = tl.where(m < M, K, 0)  # padding rows read nothing
                    x_lo = tl.load(x_ptr + m * stride_x + at, mask=at < k_m, other=0.0).to(tl.float32)
                    x_hi = tl.load(x_ptr + m * stride_x + at + H, mask=at + H < k_m, other=0.0).to(tl.float32)
                    part = tl.sum(tl.sum(lo * x_lo + hi * x_hi, axis=2), axis=1)  # [BLOCK_N]
                    acc = tl.where(ms[:, None] == m, acc + part[None, :], acc)
        if BLOCK_M == 1:
            acc = tl.sum(tl.sum(acc1, axis=2), axis=1)[None, :]
        keep = (ms[:, None] < M) & row_ok[None, :]
        if PARTIAL:
            tl.store(out_ptr + tl.program_id(1) * M * N + ms[:, None] * N + rows[None, :], acc, mask=keep)
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + ms[:, None] * N + rows[None, :], cast_out(acc, out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _dequant_kernel(
        w_ptr, out_ptr, N, K, row_bytes, n_blocks,
        QTYPE: tl.constexpr, G: tl.constexpr, H: tl.constexpr, BPS: tl.constexpr, TS: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """out[n, step's 256 columns] for BLOCK_N rows n; step = program_id(1)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        step = tl.program_id(1)
        g = tl.arange(0, G)[None, :, None]
        h = tl.arange(0, H)[None, None, :]
        base, mask = step_blocks(rows.to(tl.int64) * row_bytes, row_ok, step, n_blocks, g, G, BPS, TS)
        lo, hi = decode(w_ptr, base, g, h, mask, QTYPE)
        at = step * STEP + g * (2 * H) + h  # [1, G, H]
        dst = out_ptr + rows.to(tl.int64)[:, None, None] * K + at
        out_ty = out_ptr.dtype.element_ty
        tl.store(dst, cast_out(lo, out_ty), mask=row_ok[:, None, None] & (at < K))
        tl.store(dst + H, cast_out(hi, out_ty), mask=row_ok[:, None, None] & (at + H < K))


def _check(data: torch.Tensor, qtype: T, cols: int) -> tuple[int, int]:
    """(block values, bytes per block) of ``qtype``, once ``data`` is known to hold its rows."""
    if qtype not in _LAYOUT:
        raise NotImplementedError(f"no Triton kernel for {T(qtype).name}")
    block, size = GGML_QUANT_SIZES[qtype]
    if data.dtype != torch.uint8 or data.dim() != 2 or cols % block or data.shape[1] != cols // block * size:
        raise ValueError(f"{T(qtype).name} rows of {cols} values are uint8 [rows, {cols // block * size}], "
                         f"got {data.dtype} {tuple(data.shape)}")  # fmt: skip
    if data.stride(1) != 1:
        raise ValueError("the blocks' rows must be contiguous")
    return block, size


def _consts(qtype: T) -> dict[str, int]:
    g, h, bps = _LAYOUT[qtype]
    return {"QTYPE": int(qtype), "G": g, "H": h, "BPS": bps, "TS": GGML_QUANT_SIZES[qtype][1]}


def gguf_dequantize(data: torch.Tensor, qtype: T, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [rows, cols] in ``dtype`` that the blocks ``data`` [rows, row_bytes] encode."""
    qtype = T(qtype)
    block, _ = _check(data, qtype, cols)
    rows = data.shape[0]
    out = torch.empty(rows, cols, dtype=dtype, device=data.device)
    if rows and cols:
        grid = (triton.cdiv(rows, DEQUANT_ROWS), triton.cdiv(cols, STEP))
        _dequant_kernel[grid](data, out, rows, cols, data.stride(0), cols // block,
                              BLOCK_N=DEQUANT_ROWS, num_warps=4, **_consts(qtype))  # fmt: skip
    return out


def _split(x: torch.Tensor, rows: int, n_steps: int) -> int:
    """Spans per weight row: enough programs for ``PROGRAMS_PER_SM`` per SM, at least
    ``MIN_SPLIT_STEPS`` steps each. One in the interpreter (no SMs to fill)."""
    if not x.is_cuda:
        return 1
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    want = triton.cdiv(PROGRAMS_PER_SM * _SMS[index], triton.cdiv(rows, BLOCK_N))
    return max(1, min(want, n_steps // MIN_SPLIT_STEPS))


def _fused(
    x: torch.Tensor, data: torch.Tensor, qtype: T, cols: int, bias: torch.Tensor | None, split: int | None
) -> torch.Tensor:
    """x [M <= DECODE_ROWS, cols] (rows contiguous) -> [M, rows] in x.dtype, one kernel (plus
    torch's sum of the partials when the rows are split)."""
    block = GGML_QUANT_SIZES[qtype][0]
    m, rows = x.shape[0], data.shape[0]
    n_steps = triton.cdiv(cols, STEP)
    split = _split(x, rows, n_steps) if split is None else max(1, min(split, n_steps))
    span = triton.cdiv(n_steps, split)
    split = triton.cdiv(n_steps, span)  # no empty spans
    partial = split > 1
    out = torch.empty((split, m, rows) if partial else (m, rows), dtype=torch.float32 if partial else x.dtype,
                      device=x.device)  # fmt: skip
    grid = (triton.cdiv(rows, BLOCK_N), split)
    _gemv_kernel[grid](x, data, bias if bias is not None else out, out, m, rows, cols, data.stride(0),
                       cols // block, n_steps, span, x.stride(0), BLOCK_M=triton.next_power_of_2(m),
                       BLOCK_N=BLOCK_N, HAS_BIAS=bias is not None, PARTIAL=partial, num_warps=4,
                       **_consts(qtype))  # fmt: skip
    if not partial:
        return out
    total = out.sum(0)  # [M, rows], the spans added in one fixed order
    return (total if bias is None else total + bias.float()).to(x.dtype)


def _tiled(x: torch.Tensor, data: torch.Tensor, qtype: T, cols: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, cols] -> [M, rows]: row tiles of W dequantised to x.dtype, each through F.linear."""
    rows = data.shape[0]
    tile = max(1, TILE_BYTES // (cols * x.element_size()))
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    for start in range(0, rows, tile):
        end = min(rows, start + tile)
        w = gguf_dequantize(data[start:end], qtype, cols, x.dtype)  # [end - start, cols]
        out[:, start:end] = F.linear(x, w, None if bias is None else bias[start:end].to(x.dtype))
    return out


def gguf_linear(
    x: torch.Tensor, data: torch.Tensor, qtype: T, cols: int, bias: torch.Tensor | None = None,
    *, split: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [..., cols] (float32, bfloat16 or float16) times the weight [rows, cols] that the blocks
    ``data`` [rows, row_bytes] encode -> [..., rows] in x.dtype. ``split``: spans per weight row
    in the fused kernel (None: by the GPU's size)."""
    qtype = T(qtype)
    _check(data, qtype, cols)
    if x.shape[-1] != cols or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"gguf_linear needs float x [..., {cols}], got {x.dtype} {tuple(x.shape)}")
    if x.device != data.device or (bias is not None and (bias.device != x.device or bias.shape != (data.shape[0],))):
        raise ValueError(f"x, the blocks and the bias [{data.shape[0]}] must share a device")
    lead = x.shape[:-1]
    flat = x.reshape(-1, cols)  # [M, cols]
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    if flat.shape[0] == 0 or data.shape[0] == 0:
        return x.new_zeros(*lead, data.shape[0]) + (0 if bias is None else bias.to(x.dtype))
    if flat.shape[0] <= DECODE_ROWS:
        out = _fused(flat, data, qtype, cols, None if bias is None else bias.contiguous(), split)
    else:
        out = _tiled(flat, data, qtype, cols, bias)
    return out.view(*lead, data.shape[0])
