"""quant_linear: x @ W.T for a QuantTensor W, never holding the whole of W in float.

On CPU with the C++ kernels (``native.kernels()``), by the process's precision
(``seamline.precision``, which calls ``set_int8_activations``):

* int8 activations (``--precision fast``, the default): as llama.cpp does, activations rounded
  to int8 blocks of 32 (256 for K-quants) and multiplied with the blocks by VNNI integer dot
  products: about 2x the float kernels, at the cost of that rounding. Many rows (batched steps,
  prefill): on a CPU with AMX-INT8, the 32-wide block types go through AMX tiles from
  ``AMX_FROM_ROWS`` rows up to ``AMX_BELOW_ROWS`` (``SEAMLINE_QUANT_AMX=0`` turns it off);
  otherwise, and from ``AMX_BELOW_ROWS`` rows on (a long prompt's chunks), above ``DECODE_ROWS``
  (``K_DECODE_ROWS`` for K-quants)
  rows on dequantised bfloat16 tiles with torch's bf16 GEMM (oneDNN; AMX-BF16 where it runs).
  Rows computed alone (``set_rows_alone``, a mesh that checks its members): every row on the
  fused kernel whatever the step's rows, so a row's sums are the ones it gets alone.
* exact (``--precision exact``): up to ``EXACT_BLOCK_ROWS`` rows (a decode or batched step),
  every weight is decoded in registers as gguf-py decodes it and multiplied in float32
  (``linear_exact``): the answers of the dequantised weights, and a row's sums are the same
  whatever rows come with it. More rows (prefill): row tiles of W dequantised to float32 with
  torch's float32 GEMM (``linear_tiled``); bfloat16 activations: bfloat16 tiles.

On CUDA (``quant.gpu_matmul``, Triton kernels): up to a few rows, one kernel decodes the
blocks in registers and accumulates in float32; more rows multiply bfloat16 tiles dequantised
by a Triton kernel with torch's GEMM.

Elsewhere (no kernels, ``use_kernels=False``): row tiles dequantised, then F.linear.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from seamline.quant.dequant import dequantize
from seamline.quant.native import kernel_isa, kernels
from seamline.quant.tensor import K_TYPES, QuantTensor

DECODE_ROWS = (
    12  # up to this many rows the fused kernel beats dequantise + GEMM (measured, 2 threads)
)
# K-quants' (256-wide super-blocks) bf16 tiles cost more to dequantise: up to this many rows
# they stay on the fused kernel, by the kernels' build. Measured, one core, the 1B Q4_K_M's
# matrices: AVX-512, tiles' time / fused kernel's 1.0-1.25 at 16 rows, 0.8-1.0 at 20; the AVX2
# build with oneDNN, MKL and ATen held to AVX2 (on this AVX-512 CPU), 1.06-1.17 at 32 rows.
K_DECODE_ROWS = {"avx512": 16, "avx2": 32}
EXACT_BLOCK_ROWS = 64  # exact: up to this many rows on the blocks, beyond on float32 tiles
# the torch path's tiles, in float32 bytes (its decoders' dtype): a tile's few float temporaries
# land in glibc's heap once its mmap threshold has risen (to 29 MB as a load frees the embedded
# model's misaligned embedding copy) and stay in the process's RSS after; 8 MB temporaries held
# that model at +38 MB over its weights, 1 MiB ones hold a few MB, no slower (measured)
TILE_BYTES = 1 << 20
AMX_FROM_ROWS = (
    9  # int8 mode, a CPU with AMX-INT8: from this many rows tiles beat the AVX-512 kernel
)
# from this many rows dequantised bfloat16 tiles beat the int8 ones: each 32-wide block's int32
# sums cost 3-4 vector ops a row to scale (by its own scales), where bf16 tiles accumulate in
# float across the whole row, and their dequantising is shared by more rows (measured, the
# embedded model's matmuls, one core with AMX: 128 rows 69 ms int8 against 71 bf16, 192 rows 103
# against 75, 512 rows 253 against 118)
AMX_BELOW_ROWS = 160
AMX_ENV = "SEAMLINE_QUANT_AMX"  # "0": never AMX tiles
_KERNEL_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))


_OP: list[Callable[..., torch.Tensor] | None] = []  # the kernel op (or None), resolved on first use
_EXACT: list[
    tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] | None
] = []  # the exact (float32) ops: on the blocks, on tiles
_K_ROWS: list[int] = []  # K_DECODE_ROWS of this CPU's build, resolved on first use
INT8_ACTIVATIONS = False  # set by ``set_int8_activations`` (seamline.precision.apply)
# set by ``set_rows_alone``: int8 rows on the fused kernel at any step size (and, in
# ``model.attention``, each row attending as a decode row)
ROWS_ALONE = False
_AMX_FROM = 0 if os.environ.get(AMX_ENV) == "0" else AMX_FROM_ROWS  # the op checks the CPU itself


def set_int8_activations(on: bool) -> None:
    """Round activations to int8 blocks in every quantized matmul of this process (or not)."""
    global INT8_ACTIVATIONS
    INT8_ACTIVATIONS = on


def set_rows_alone(on: bool) -> None:
    """Compute every row of an int8 matmul as it would alone (the fused kernel, no tiles),
    whatever rows its step holds: a checked mesh's stages and its reference agree to the bit."""
    global ROWS_ALONE
    ROWS_ALONE = on


def same_arithmetic_rows() -> int:
    """The most rows a step may hold while each row's products are the ones it gets alone: past
    it the kernels change method (AMX tiles or bfloat16 tiles; float32 tiles when exact)."""
    if INT8_ACTIVATIONS and ROWS_ALONE:
        return sys.maxsize
    if INT8_ACTIVATIONS:
        return _AMX_FROM - 1 if _AMX_FROM else DECODE_ROWS
    return EXACT_BLOCK_ROWS


def _kernel_op() -> Callable[..., torch.Tensor] | None:
    if not _OP:  # a plain list, not a cache wrapper, so that torch.compile traces through
        ops = kernels()
        _OP.append(None if ops is None else ops.linear.default)
    return _OP[0]


def _decode_rows(qtype: int) -> int:
    """The most rows of a ``qtype`` weight's matmul on the fused int8 kernel."""
    if qtype not in K_TYPES:
        return DECODE_ROWS
    if not _K_ROWS:
        _K_ROWS.append(K_DECODE_ROWS.get(kernel_isa() or "", DECODE_ROWS))
    return _K_ROWS[0]


def _exact_ops() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] | None:
    if not _EXACT:
        ops = kernels()
        _EXACT.append(None if ops is None else (ops.linear_exact.default, ops.linear_tiled.default))
    return _EXACT[0]


_GPU: list[ModuleType | None] = []  # quant.gpu_matmul, or None where Triton is missing


def _gpu_kernels(x: torch.Tensor) -> ModuleType | None:
    """The Triton kernels' module, imported on first use (Triton is no dependency on a CPU)."""
    if not _GPU:
        try:
            from seamline.quant import gpu_matmul
        except ImportError:
            _GPU.append(None)
        else:
            _GPU.append(gpu_matmul if gpu_matmul.available(x) else None)
    return _GPU[0]


def quant_linear(
    x: torch.Tensor, w: QuantTensor, bias: torch.Tensor | None = None, *, use_kernels: bool = True
) -> torch.Tensor:
    """x [..., cols] -> [..., rows] in x.dtype, for a 2-D ``w`` [rows, cols]; ``use_kernels=False``
    forces the torch path (dequantised tiles, F.linear)."""
    if use_kernels and x.is_cpu and x.dtype in _KERNEL_DTYPES:
        if INT8_ACTIVATIONS:
            op = _kernel_op()
            if op is not None:  # the op checks shapes, device and type itself (ValueError)
                if ROWS_ALONE:
                    return op(x, w.data, w.qtype, w.shape[-1], bias, sys.maxsize, 0)
                amx = _AMX_FROM if x.numel() < AMX_BELOW_ROWS * x.shape[-1] else 0
                return op(x, w.data, w.qtype, w.shape[-1], bias, _decode_rows(w.qtype), amx)
        elif (x.dtype == torch.float32 or x.numel() <= EXACT_BLOCK_ROWS * x.shape[-1]) and (
            exact := _exact_ops()
        ) is not None:
            rows = x.reshape(-1, x.shape[-1])
            op = exact[0] if rows.shape[0] <= EXACT_BLOCK_ROWS else exact[1]
            return (
                op(rows, w.data, w.qtype, w.shape[-1], bias)
                .to(x.dtype)
                .view(*x.shape[:-1], w.shape[0])
            )
        elif (op := _kernel_op()) is not None:
            return op(x, w.data, w.qtype, w.shape[-1], bias, 0)  # dequantised bf16 tiles, bf16 GEMM
    if (
        use_kernels
        and x.is_cuda
        and (gpu := _gpu_kernels(x)) is not None
        and w.qtype in gpu.SUPPORTED
    ):
        return gpu.gguf_linear(x, w.data, w.qtype, w.shape[-1], bias)
    if len(w.shape) != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"quant_linear needs x [..., {w.shape[-1]}] and a 2-D weight, got {tuple(x.shape)} x {w.shape}"
        )
    return _tiled(x, w, bias, use_kernels)


def _tiled(
    x: torch.Tensor, w: QuantTensor, bias: torch.Tensor | None, use_kernels: bool
) -> torch.Tensor:
    """F.linear over row tiles of ``w`` dequantised one at a time (about ``TILE_BYTES`` each)."""
    rows, cols = w.shape
    tile = max(
        16, TILE_BYTES // (cols * 4)
    )  # float32: what the decoders compute in, whatever x's dtype
    parts = [
        F.linear(
            x,
            dequantize(
                QuantTensor(w.qtype, w.data[start : start + tile], (min(tile, rows - start), cols)),
                x.dtype,
                use_kernels=use_kernels,
            ),
        )
        for start in range(0, rows, tile)
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return out if bias is None else out + bias.to(x.dtype)
