"""The Triton GGUF kernels (``quant/triton_gguf.py``) against gguf-py's dequantiser: on CUDA where
there is one, and in Triton's interpreter on CPU tensors where there is none (the conftest sets
``TRITON_INTERPRET=1`` before any kernel is defined).

Tolerances, as max |y - ref| / max |ref|, ref = x @ gguf-py's float32 weight in float64:
- float32 activations: 1e-4 (float32 sums; the many-rows path is a float32 GEMM);
- bfloat16 activations: 1e-2 (the output rounded to bfloat16, 2^-9 relative, and past
  ``DECODE_ROWS`` rows the weight too);
- the dequantiser: bit-identical to gguf-py in float32, that value rounded once in bf16 / fp16.
"""

from __future__ import annotations

import importlib
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from seamline.quant.bench_kernels import random_weight

pytest.importorskip("triton", reason="triton is a test dependency (pip install -e '.[test]')")
from seamline.quant import triton_gguf  # noqa: E402  (after the skip: it needs triton to test anything)

TYPES = sorted(triton_gguf.SUPPORTED)
ROWS = 36  # not a multiple of the kernels' row blocks
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
DEVICES = [
    pytest.param("cpu", id="interpreter"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


def _on(device: str) -> torch.device:
    dev = torch.device(device)
    if not triton_gguf.available(torch.empty(0, device=dev)):
        pytest.skip("Triton's interpreter runs only where there is no CUDA (TRITON_INTERPRET=1, set by the conftest)")
    return dev


def _cols(qtype: T) -> int:
    """15 blocks of 32 (the last 256-value step partial), or two K-quant superblocks."""
    return 480 if GGML_QUANT_SIZES[qtype][0] == 32 else 512


def _weight(qtype: T, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [rows, row_bytes], gguf-py's float32 weight [rows, cols]): gguf-py quantizes
    the 32-wide types; it has no K-quant quantizer, so those are random valid blocks."""
    if GGML_QUANT_SIZES[qtype][0] == 32:
        values = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32) * 0.05
        raw = np.ascontiguousarray(gguf.quants.quantize(values, qtype))
    else:
        raw = random_weight(qtype, (rows, cols), torch.Generator().manual_seed(seed)).data.numpy()
    dense = np.ascontiguousarray(gguf.quants.dequantize(raw, qtype)).reshape(rows, cols)
    return torch.from_numpy(raw), torch.from_numpy(dense)


def _assert_close(y: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    err = ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert err <= tol, f"{what}: max error {err:.2e} of max |ref| (tolerance {tol:.0e})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_triton_dequantize_matches_gguf(qtype: T, device: str) -> None:
    dev = _on(device)
    cols = _cols(qtype)
    raw, dense = _weight(qtype, ROWS, cols)
    assert torch.equal(triton_gguf.gguf_dequantize(raw.to(dev), qtype, cols).cpu(), dense)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(triton_gguf.gguf_dequantize(raw.to(dev), qtype, cols, dtype).cpu(), dense.to(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_triton_linear_matches_gguf(qtype: T, dtype: torch.dtype, device: str) -> None:
    dev = _on(device)
    cols = _cols(qtype)
    raw, dense = _weight(qtype, ROWS, cols, seed=1)
    gen = torch.Generator().manual_seed(2)
    for m in (1, 7, 64):  # 64 > DECODE_ROWS: dequantised tiles and torch's GEMM
        x = torch.randn(m, cols, generator=gen).to(dtype)
        ref = x.double() @ dense.double().T
        y = triton_gguf.gguf_linear(x.to(dev), raw.to(dev), qtype, cols)
        assert y.dtype == dtype and y.shape == (m, ROWS)
        _assert_close(y, ref, TOLERANCE[dtype], f"{qtype.name} {m} rows {dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [T.Q5_1, T.Q6_K], ids=lambda t: t.name)
def test_triton_split_rows_bias_and_batched_x(qtype: T, device: str) -> None:
    """Rows split into spans (partial sums), a bias, x with leading dims and strided rows."""
    dev = _on(device)
    cols = 5 * 256  # five steps: spans of 2, 2, 1 at split 3
    raw, dense = _weight(qtype, ROWS, cols, seed=3)
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(ROWS, generator=gen)
    wide = torch.randn(2, 3, 2 * cols, generator=gen)
    x = wide[..., :cols]  # [2, 3, cols], rows strided by 2 * cols
    ref = x.double() @ dense.double().T + bias.double()
    for split in (None, 1, 2, 3, 99):
        y = triton_gguf.gguf_linear(x.to(dev), raw.to(dev), qtype, cols, bias.to(dev), split=split)
        assert y.shape == (2, 3, ROWS)
        _assert_close(y, ref, TOLERANCE[torch.float32], f"split {split}")
    many = torch.randn(40, cols, generator=gen)
    y = triton_gguf.gguf_linear(many.to(dev), raw.to(dev), qtype, cols, bias.to(dev))
    _assert_close(y, many.double() @ dense.double().T + bias.double(), TOLERANCE[torch.float32], "tiles")


@pytest.mark.parametrize("device", DEVICES)
def test_triton_linear_refuses_blocks_of_another_shape(device: str) -> None:
    dev = _on(device)
    raw, _ = _weight(T.Q8_0, 4, 64)
    x = torch.randn(1, 64, device=dev)
    with pytest.raises(ValueError, match="Q8_0 rows of 96 values"):
        triton_gguf.gguf_linear(torch.randn(1, 96, device=dev), raw.to(dev), T.Q8_0, 96)
    with pytest.raises(ValueError, match="float x"):
        triton_gguf.gguf_linear(x, raw.to(dev), T.Q8_0, 48)
    with pytest.raises(NotImplementedError, match="no Triton kernel for Q2_K"):
        triton_gguf.gguf_linear(x, raw.to(dev), T.Q2_K, 64)


def test_triton_module_imports_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """seamline imports on a machine without Triton: the module loads and says it is unavailable."""
    for name in [n for n in sys.modules if n == "triton" or n.startswith(("triton.", "seamline.quant.triton_"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # ``import triton`` raises ImportError
    bare = importlib.import_module("seamline.quant.triton_gguf")
    assert bare is not triton_gguf and not bare.available(torch.zeros(1))
    assert T.Q4_K in bare.SUPPORTED
