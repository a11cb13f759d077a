"""Quantized matmul kernels and dequantisers against gguf-py's reference dequantiser.

Tolerances (activations are rounded by the fast paths, weights never are):
- decode kernel (<= DECODE_ROWS rows): activations rounded to int8 per block of 32 (256 for
  K-quants): ||y - ref|| <= 1.5% of ||ref||, max |y - ref| <= 3% of max |ref|;
- prefill (more rows): activations, weights and output rounded to bfloat16: same bounds;
- dequantisers (torch and C++): bit-identical to gguf-py in float32, once rounded otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from seamline.quant import matmul, native
from seamline.quant.bench_kernels import KERNEL_TYPES, random_weight
from seamline.quant.dequant import dequantize, dequantize_rows
from seamline.quant.matmul import AMX_BELOW_ROWS, DECODE_ROWS, K_DECODE_ROWS, quant_linear
from seamline.quant.tensor import K_TYPES, QuantTensor

REL_NORM, REL_MAX = 0.015, 0.03


def _cols(qtype, blocks: int) -> int:
    return GGML_QUANT_SIZES[qtype][0] * blocks


def _reference(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """gguf-py's dequantised weight times x, in float64."""
    raw = w.data.contiguous().numpy()
    dense = (
        torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, w.qtype)))
        .reshape(w.shape)
        .double()
    )
    return x.double() @ dense.T


def _assert_close(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (y.double() - ref).abs()
    rel_norm = (err.norm() / ref.norm()).item()
    rel_max = (err.max() / ref.abs().max()).item()
    assert rel_norm <= REL_NORM and rel_max <= REL_MAX, (
        f"{what}: rel norm {rel_norm:.4f}, rel max {rel_max:.4f}"
    )


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
def test_dequantize_matches_gguf_exactly(qtype, use_kernels, request) -> None:
    if use_kernels:
        request.getfixturevalue("ops")  # the C++ decoders must be what runs here
    gen = torch.Generator().manual_seed(1)
    blocks = 3 if qtype.name.endswith("K") else 5  # an odd count of 32-wide blocks: a half pair
    w = random_weight(qtype, (3, 5, _cols(qtype, blocks)), gen)  # experts x rows x cols
    ref = torch.from_numpy(gguf_dequantize(w.data.numpy(), qtype)).reshape(w.shape)
    assert torch.equal(dequantize(w, use_kernels=use_kernels), ref)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(dequantize(w, dtype, use_kernels=use_kernels), ref.to(dtype))
    flat = w.select(1)
    ids = torch.tensor([[4, 0], [2, 4]])
    assert torch.equal(dequantize_rows(flat, ids, use_kernels=use_kernels), ref[1][ids])
    assert torch.equal(
        dequantize(w.select(2).row_slice(1, 4), use_kernels=use_kernels), ref[2, 1:4]
    )


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_dequant_bf16_kernel_matches_torch(ops, qtype) -> None:
    gen = torch.Generator().manual_seed(2)
    for blocks in (1, 2, 3):
        w = random_weight(qtype, (9, _cols(qtype, blocks)), gen)
        want = dequantize(w, torch.bfloat16)
        for bf16_ops in (True, False):  # AVX512-BF16 rounding (where present) and integer rounding
            got = ops.dequant_bf16(w.data, int(qtype), w.shape[1], bf16_ops)
            assert torch.equal(got, want), f"{blocks} blocks, bf16 instructions {bf16_ops}"


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
def test_quant_linear_matches_reference(qtype, dtype, use_kernels, request) -> None:
    if use_kernels:
        request.getfixturevalue("ops")  # the kernels must be what runs here
    gen = torch.Generator().manual_seed(3)
    blocks = 6 if qtype.name.endswith("K") else 19  # an odd count of 32-wide blocks: a half pair
    w = random_weight(qtype, (40, _cols(qtype, blocks)), gen)
    for rows in (1, 3, 7, DECODE_ROWS, DECODE_ROWS + 1, 64):
        x = torch.randn(rows, w.shape[1], generator=gen).to(dtype)
        y = quant_linear(x, w, use_kernels=use_kernels)
        assert y.dtype == dtype and y.shape == (rows, 40)
        _assert_close(y, _reference(x, w), f"{qtype.name} {dtype} {rows} rows")


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_kernel_matches_reference(ops, qtype, dtype) -> None:
    """The int8-activation op (``--precision fast``) whatever this process's precision."""
    gen = torch.Generator().manual_seed(7)
    blocks = 6 if qtype.name.endswith("K") else 19  # an odd count of 32-wide blocks: a half pair
    w = random_weight(qtype, (40, _cols(qtype, blocks)), gen)
    bias = torch.randn(40, generator=gen)
    for rows in (1, 2, 3, 4, 5, 7, 12, 13, 64):
        x = torch.randn(rows, w.shape[1], generator=gen).to(dtype)
        for decode_rows in (0, 16):  # bf16 tiles and GEMM / the fused int8 kernel
            y = ops.linear(x, w.data, w.qtype, w.shape[1], bias, decode_rows)
            assert y.dtype == dtype and y.shape == (rows, 40)
            _assert_close(
                y,
                _reference(x, w) + bias.double(),
                f"{qtype.name} {dtype} {rows} rows, {decode_rows}",
            )
        part = ops.linear(x, w.row_slice(3, 29).data, w.qtype, w.shape[1], None, 16)
        assert torch.equal(part, ops.linear(x, w.data, w.qtype, w.shape[1], None, 16)[:, 3:29])


def _rounded_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x rounded as the kernels round it, in float32 (scale amax / 127 per block of 32, or of 256
    for K-quants; quants to nearest even), then widened to float64."""
    blocks = x.float().reshape(x.shape[0], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    quants = torch.round(blocks * inverse)
    return ((amax / 127.0).double() * quants.double()).reshape(x.shape)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_int8_kernel_is_the_int8_block_arithmetic(ops, qtype) -> None:
    """Tighter than the tolerance above: the int8 kernel's sums are those of the rounded
    activations times the dequantised weights, up to float32 accumulation (each build: AVX-512
    as written, AVX2 emulated)."""
    gen = torch.Generator().manual_seed(11)
    block = 256 if qtype.name.endswith("K") else 32
    w = random_weight(qtype, (48, 2048), gen)
    x = torch.randn(3, 2048, generator=gen)
    y = ops.linear(x, w.data, w.qtype, 2048, None, 16).double()
    ref = _reference(_rounded_activations(x, block), w)
    assert (y - ref).abs().max().item() <= 2e-6 * ref.abs().max().item(), qtype.name


AMX_TYPES = [t for t in KERNEL_TYPES if not t.name.endswith("K")]  # the 32-wide block types


@pytest.mark.parametrize("qtype", AMX_TYPES, ids=lambda t: t.name)
def test_amx_tiles_match_the_vnni_kernel(ops, qtype) -> None:
    """AMX tiles (many rows) against the AVX-512 int8 kernel on the same int8 activations:
    equal up to float summation order (float32 out), for row counts around the 16-row tile,
    weight rows not a multiple of 16, a bias, and bfloat16 and float16 activations."""
    if not ops.amx_supported():
        with open("/proc/cpuinfo") as f:
            assert "amx_int8" not in f.read(), "this CPU has AMX-INT8 but the kernels cannot use it"
        return
    gen = torch.Generator().manual_seed(8)
    w = random_weight(qtype, (45, _cols(qtype, 18)), gen)
    bias = torch.randn(45, generator=gen)
    for rows in (1, 5, 16, 17, 40, 130):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(rows, w.shape[1], generator=gen).to(dtype)
            vnni = ops.linear(x, w.data, w.qtype, w.shape[1], bias, 1 << 20, 0)
            amx = ops.linear(x, w.data, w.qtype, w.shape[1], bias, 0, 1)
            assert amx.dtype == dtype and amx.shape == (rows, 45)
            if dtype == torch.float32:
                assert torch.allclose(amx, vnni, rtol=1e-5, atol=1e-5 * vnni.abs().max().item()), (
                    qtype.name,
                    rows,
                )
            _assert_close(
                amx, _reference(x, w) + bias.double(), f"AMX {qtype.name} {dtype} {rows} rows"
            )
    odd = random_weight(
        qtype, (20, _cols(qtype, 19)), gen
    )  # a half pair: the AVX-512 kernel takes it
    x = torch.randn(40, odd.shape[1], generator=gen)
    assert torch.equal(
        ops.linear(x, odd.data, odd.qtype, odd.shape[1], None, 0, 1),
        ops.linear(x, odd.data, odd.qtype, odd.shape[1], None, 0, 0),
    )


def test_int8_mode_takes_bfloat16_tiles_for_a_long_chunk(ops, monkeypatch) -> None:
    """With int8 activations, fewer than AMX_BELOW_ROWS rows go to the int8 kernels (AMX tiles
    where the CPU has them), more to dequantised bfloat16 tiles: each AMX block's scaling would
    cost more than the bf16 GEMM there."""
    monkeypatch.setattr(matmul, "INT8_ACTIVATIONS", True)
    gen = torch.Generator().manual_seed(9)
    qtype = AMX_TYPES[0]
    w = random_weight(qtype, (45, _cols(qtype, 18)), gen)
    for rows in (AMX_BELOW_ROWS - 1, AMX_BELOW_ROWS):
        x = torch.randn(rows, w.shape[1], generator=gen).to(torch.bfloat16)
        tiles = ops.linear(x, w.data, w.qtype, w.shape[1], None, DECODE_ROWS, 0)
        amx = ops.linear(
            x, w.data, w.qtype, w.shape[1], None, DECODE_ROWS, matmul._AMX_FROM
        )  # 0: SEAMLINE_QUANT_AMX=0
        assert torch.equal(quant_linear(x, w), amx if rows < AMX_BELOW_ROWS else tiles), rows
        if ops.amx_supported() and matmul._AMX_FROM:  # else both are the tiles
            assert not torch.equal(amx, tiles)
        _assert_close(quant_linear(x, w), _reference(x, w), f"{rows} rows")


@pytest.mark.parametrize("qtype", sorted(K_TYPES), ids=lambda t: t.name)
def test_int8_mode_keeps_k_quants_on_the_fused_kernel_for_more_rows(
    ops, qtype, monkeypatch
) -> None:
    """With int8 activations a K-quant matmul stays on the fused kernel up to its build's
    K_DECODE_ROWS rows (past DECODE_ROWS: its tiles cost more to dequantise than the 32-wide
    types'), and one row more takes the bfloat16 tiles."""
    monkeypatch.setattr(matmul, "INT8_ACTIVATIONS", True)
    most = K_DECODE_ROWS[native.kernel_isa()]
    assert most > DECODE_ROWS
    gen = torch.Generator().manual_seed(10)
    w = random_weight(qtype, (40, _cols(qtype, 6)), gen)
    for rows in (DECODE_ROWS + 1, most, most + 1):
        x = torch.randn(rows, w.shape[1], generator=gen)
        fused = ops.linear(x, w.data, w.qtype, w.shape[1], None, rows, 0)
        tiles = ops.linear(x, w.data, w.qtype, w.shape[1], None, 0, 0)
        assert not torch.equal(fused, tiles)
        assert torch.equal(quant_linear(x, w), fused if rows <= most else tiles), rows
        _assert_close(quant_linear(x, w), _reference(x, w), f"{rows} rows")


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_slices_and_experts(ops, qtype) -> None:
    gen = torch.Generator().manual_seed(4)
    w = random_weight(qtype, (3, 24, _cols(qtype, 2)), gen)
    for rows in (1, 5, 33):
        x = torch.randn(2, rows, w.shape[-1], generator=gen)  # a leading batch dim too
        for e in range(3):
            expert = w.select(e)
            whole = quant_linear(x, expert)
            _assert_close(whole, _reference(x, expert), f"{qtype.name} expert {e}")
            part = quant_linear(x, expert.row_slice(5, 17))
            assert torch.equal(part, whole[..., 5:17]), "a row slice is a view of the same rows"


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_torch_path_matches_kernel_path(ops, qtype) -> None:
    gen = torch.Generator().manual_seed(5)
    w = random_weight(qtype, (20, _cols(qtype, 2)), gen)
    bias = torch.randn(20, generator=gen)
    for rows in (1, 9, 40):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(rows, w.shape[1], generator=gen).to(dtype)
            fast = quant_linear(x, w, bias)
            slow = quant_linear(x, w, bias, use_kernels=False)
            assert fast.dtype == slow.dtype == dtype
            _assert_close(fast, slow.double(), f"{qtype.name} {dtype} {rows} rows")
            _assert_close(
                fast, _reference(x, w) + bias.double(), f"{qtype.name} {dtype} {rows} rows + bias"
            )


def test_switch_turns_kernels_off(monkeypatch) -> None:
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.kernels.__wrapped__() is None


def test_quant_linear_refuses_wrong_shapes(ops) -> None:
    w = random_weight(KERNEL_TYPES[0], (4, 64))
    with pytest.raises(ValueError):
        quant_linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError):
        quant_linear(torch.randn(2, 64), random_weight(KERNEL_TYPES[0], (2, 4, 64)))
    with pytest.raises(ValueError):  # blocks that do not hold the stated columns
        ops.linear(torch.randn(2, 96), w.data, w.qtype, 96, None, 16)


def test_strided_activations_and_thread_counts(ops) -> None:
    """Rows are independent, so any activation layout and any thread count give the same bits."""
    gen = torch.Generator().manual_seed(6)
    w = random_weight(KERNEL_TYPES[5], (37, 512), gen)  # Q4_K
    big = torch.randn(5, 700, generator=gen)
    x = big[:, 100:612]  # rows 700 apart
    xt = torch.randn(512, 5, generator=gen).T  # columns not contiguous
    paths = (lambda v: quant_linear(v, w), lambda v: ops.linear(v, w.data, w.qtype, 512, None, 16))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [f(v) for f in paths for v in (x, xt)]
        torch.set_num_threads(2)
        two = [f(v) for f in paths for v in (x, xt)]
    finally:
        torch.set_num_threads(threads)
    for k, (a, b) in enumerate(zip(one, two)):
        v = (x, xt)[k % 2]
        assert torch.equal(a, b)
        assert torch.equal(a, paths[k // 2](v.contiguous()))
        _assert_close(a, _reference(v, w), "strided activations")
