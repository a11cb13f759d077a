"""The Triton forms of a layer's small steps (``model/gpu_kernels.py``) give the eager torch forms'
answers: on CUDA where there is one, else in Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set by the conftest before any kernel is defined)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip(
    "triton", reason="triton is a test dependency (pip install -e '.[test]')"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _rounded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``values`` in ``dtype`` as a kernel stores them: to nearest on a GPU; Triton's
    interpreter casts float32 to bfloat16 by truncation (seen here: its bits, not numpy's rounding)."""
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        return (values.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return values.to(dtype)


@pytest.fixture(scope="module")
def kernels():
    from seamline.model import gpu_kernels

    return gpu_kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rms_norm_equals_torch(kernels, dtype: torch.dtype) -> None:
    x = torch.randn(5, 96, device=DEVICE).to(dtype)
    w = torch.randn(96, device=DEVICE).to(dtype)
    want = F.rms_norm(x.float(), (96,), w.float(), 1e-6).to(dtype)
    torch.testing.assert_close(
        kernels.rms_norm(x, w, 1e-6), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_add_rms_norm_equals_torch(kernels, dtype: torch.dtype) -> None:
    x, d = (torch.randn(3, 80, device=DEVICE).to(dtype) for _ in range(2))
    w = torch.randn(80, device=DEVICE).to(dtype)
    total = _rounded(x.float() + d.float(), dtype)
    want = F.rms_norm(total.float(), (80,), w.float(), 1e-5).to(dtype)
    got_total, got = kernels.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(got_total, total)
    torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("rows", [1, 4])
def test_triton_silu_mul_equals_torch(kernels, rows: int) -> None:
    gate_up = torch.randn(rows, 2 * 1100, device=DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
