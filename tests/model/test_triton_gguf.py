"""The GPU's GGUF kernels (``quant/gpu_matmul.py``) against gguf-py's dequantiser followed by a
float matmul, for every quant type: on CUDA where there is one, else in Triton's interpreter on
CPU tensors (``TRITON_INTERPRET=1``, set by the conftest). Weights are random blocks with finite
scales (``bench_kernels.random_weight``); 40 weight rows, not a multiple of a program's 16.

Tolerances: the dequantised values are gguf-py's exactly (float32); the fused kernel multiplies
in IEEE float32 and the tiled path in float32 for float32 activations, so a product differs from
float64's by summation order only (1e-5 of the output's scale); bfloat16 activations: the output
(and past 16 rows the weight) rounded to bfloat16, 1.5% of the norm."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from seamline.quant.bench_kernels import KERNEL_TYPES, random_weight

pytest.importorskip("triton", reason="triton is a test dependency (pip install -e '.[test]')")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
ROWS = 40


@pytest.fixture(scope="module")
def gpu():
    from seamline.quant import gpu_matmul

    return gpu_matmul


def _weight(qtype, seed: int):
    cols = GGML_QUANT_SIZES[qtype][0] * (2 if qtype.name.endswith("K") else 5)
    w = random_weight(qtype, (ROWS, cols), torch.Generator().manual_seed(seed))
    dense = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(w.data.numpy(), qtype))).reshape(
        ROWS, cols
    )
    return w, dense


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_triton_dequantize_equals_gguf(gpu, qtype) -> None:
    w, dense = _weight(qtype, 1)
    got = gpu.gguf_dequantize(w.data.to(DEVICE), qtype, w.shape[1])
    assert torch.equal(got.cpu(), dense)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_triton_linear_equals_gguf_dequantize_then_matmul(gpu, qtype, rows: int) -> None:
    """1 and 7 rows decode the blocks in the matmul; 64 multiply dequantised tiles."""
    w, dense = _weight(qtype, 2)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(3))
    bias = torch.randn(ROWS, generator=torch.Generator().manual_seed(4))
    want = x.double() @ dense.double().T + bias.double()
    got = (
        gpu.gguf_linear(x.to(DEVICE), w.data.to(DEVICE), qtype, w.shape[1], bias.to(DEVICE))
        .cpu()
        .double()
    )
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("rows", [3, 40])
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_triton_linear_in_bfloat16(gpu, qtype, rows: int) -> None:
    w, dense = _weight(qtype, 5)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    want = x.double() @ dense.double().T
    got = gpu.gguf_linear(x.to(DEVICE), w.data.to(DEVICE), qtype, w.shape[1]).cpu()
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).norm() / want.norm()).item() <= 0.015


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch sees none here)")
def test_triton_kernels_serve_quant_linear_on_cuda() -> None:
    """``quant_linear`` of a CUDA activation goes to the kernels."""
    from seamline.quant.matmul import quant_linear

    qtype = KERNEL_TYPES[-1]
    w, dense = _weight(qtype, 7)
    x = torch.randn(2, w.shape[1])
    got = quant_linear(x.cuda(), w.to("cuda")).cpu().double()
    want = x.double() @ dense.double().T
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
