"""The fused C++ ops of a layer's small steps (``quant/kernels/decode.cpp``) against eager torch.

Tolerances: the ops compute in float32 and round once, eager torch rounds after every op, so
float32 results agree to 1e-5 relative; bfloat16 and float16 ones to two units of their last
place (relative 2**-7 and 2**-10 of the largest value).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seamline.app import LocalModel, default_model_path
from seamline.model import fused
from seamline.model.attention import GQAttention
from seamline.model.rope import apply_rotary
from seamline.params import SamplingParams

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 * 2**-8, torch.float16: 2 * 2**-11}


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    scale = want.double().abs().max().item()
    err = (got.double() - want.double()).abs().max().item()
    assert err <= TOLERANCE[dtype] * max(scale, 1.0), (
        f"max error {err:.3g} at scale {scale:.3g} ({dtype})"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (7, 100), (3, 2, 40)])
def test_norms_and_gate_equal_torch(ops, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(shape, generator=gen) * 3 for _ in range(2))
    weight = torch.rand(shape[-1], generator=gen) + 0.5
    eps = 1e-5
    want = F.rms_norm(x.double(), (shape[-1],), weight.double(), eps)
    _assert_close(ops.rms_norm(x.to(dtype), weight.to(dtype), eps), want, dtype)
    total = (x.to(dtype) + delta.to(dtype)).double()  # the sum is rounded before the norm, as eager
    got_total, got_norm = ops.add_rms_norm(x.to(dtype), delta.to(dtype), weight.to(dtype), eps)
    assert torch.equal(got_total, total.to(dtype))
    _assert_close(got_norm, F.rms_norm(total, (shape[-1],), weight.double(), eps), dtype)
    gate_up = torch.cat((x * 4, delta), dim=-1)  # gates from about -40 to 40: both tails of silu
    gate, up = gate_up.double().chunk(2, dim=-1)
    _assert_close(ops.silu_mul(gate_up.to(dtype)), F.silu(gate) * up, dtype)


def test_silu_mul_at_the_extremes(ops) -> None:
    gate = torch.tensor([-1e4, -100.0, -88.0, 0.0, 88.0, 100.0, 1e4, float("inf"), float("-inf")])
    got = ops.silu_mul(torch.cat((gate, torch.ones_like(gate))).unsqueeze(0))
    want = F.silu(gate.double()).float()
    assert torch.allclose(
        got[0], want, rtol=1e-6, atol=1e-30, equal_nan=True
    )  # silu(-inf) is nan in both


def _eager_attention(qkv, cos, sin, keys, values, pos, heads, kv_heads, window=0):
    """RoPE, cache write and SDPA in eager torch, in float64 (keys/values: the cache before),
    over positions (pos - window, pos] (window 0: every one)."""
    dim = keys.shape[-1]
    parts = qkv.double().view(1, heads + 2 * kv_heads, dim)
    qk = apply_rotary(
        parts[:, : heads + kv_heads], cos[pos : pos + 1].double(), sin[pos : pos + 1].double()
    )
    q, k, v = qk[:, :heads], qk[:, heads:], parts[:, heads + kv_heads :]
    keys, values = keys.double().clone(), values.double().clone()
    keys[:, pos], values[:, pos] = k[0], v[0]
    first = max(0, pos - window + 1) if window else 0
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys[:, first : pos + 1].unsqueeze(0),
        values[:, first : pos + 1].unsqueeze(0),
        enable_gqa=True,
    )
    return out.reshape(1, heads * dim), keys, values


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,dim,pos,window",
    [
        (9, 3, 64, 0, 0),
        (9, 3, 64, 300, 0),
        (4, 4, 40, 17, 0),
        (8, 1, 128, 5, 0),
        (8, 2, 128, 40, 0),
        (4, 2, 64, 33, 0),
        (9, 3, 64, 300, 32),
        (4, 4, 40, 17, 5),
        (4, 2, 64, 3, 8),
        (8, 2, 128, 40, 1),
    ],
)
def test_decode_attention_equals_rope_cache_and_sdpa(
    ops, dtype, heads, kv_heads, dim, pos, window
) -> None:
    """``window``: a sliding window's keys (0: all of them)."""
    gen = torch.Generator().manual_seed(pos)
    capacity = pos + 9
    qkv = torch.randn(1, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.rand(capacity, dim // 2, generator=gen) * 6
    cos, sin = (
        torch.cat((angles, angles), -1).cos().to(dtype),
        torch.cat((angles, angles), -1).sin().to(dtype),
    )
    keys, values = (torch.randn(kv_heads, capacity, dim, generator=gen).to(dtype) for _ in range(2))
    want, want_keys, want_values = _eager_attention(
        qkv, cos, sin, keys, values, pos, heads, kv_heads, window
    )
    got = ops.decode_attention(qkv, cos, sin, keys, values, pos, heads, kv_heads, window)
    _assert_close(got, want, dtype)
    _assert_close(keys, want_keys, dtype)  # the new key, rotated, was written at pos; nothing else
    assert torch.equal(values, want_values.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 16])
def test_batched_decode_attention_equals_one_call_per_sequence(ops, dtype, window) -> None:
    """Five sequences at different positions in one call: the same output rows and the same
    cache writes as five calls of the one-row op (``window``: a sliding window's keys)."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, positions = 9, 3, 64, [0, 7, 31, 130, 2]
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.rand(140, dim // 2, generator=gen) * 6
    cos, sin = (
        torch.cat((angles, angles), -1).cos().to(dtype),
        torch.cat((angles, angles), -1).sin().to(dtype),
    )
    caches = [
        [torch.randn(kv_heads, p + 4, dim, generator=gen).to(dtype) for _ in range(2)]
        for p in positions
    ]
    alone = [[k.clone(), v.clone()] for k, v in caches]
    got = ops.decode_attention_batch(
        qkv,
        cos,
        sin,
        [k for k, _ in caches],
        [v for _, v in caches],
        positions,
        heads,
        kv_heads,
        window,
    )
    for row, (pos, (k, v)) in enumerate(zip(positions, alone)):
        one = ops.decode_attention(qkv[row : row + 1], cos, sin, k, v, pos, heads, kv_heads, window)
        assert torch.equal(got[row : row + 1], one)
        assert torch.equal(caches[row][0], k) and torch.equal(caches[row][1], v)
    with pytest.raises(ValueError, match="B caches and positions"):
        ops.decode_attention_batch(
            qkv,
            cos,
            sin,
            [k for k, _ in caches][:2],
            [v for _, v in caches],
            positions,
            heads,
            kv_heads,
        )


def test_decode_attention_refuses_bad_shapes(ops) -> None:
    qkv, table = torch.zeros(1, 5 * 8), torch.zeros(4, 8)
    cache = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="outside the cache"):
        ops.decode_attention(qkv, table, table, cache, cache.clone(), 4, 3, 1)
    with pytest.raises(ValueError, match="qkv must be"):
        ops.decode_attention(torch.zeros(1, 7), table, table, cache, cache.clone(), 0, 3, 1)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        ops.decode_attention(qkv, table, table, cache, cache.clone(), 0, 3, 2)


def test_torch_forms_answer_when_the_ops_cannot(ops) -> None:
    """A non-contiguous input takes the eager form, with the same answer."""
    x = torch.randn(6, 64)[:, ::2]
    weight = torch.rand(32) + 0.5
    assert fused.op_for(x, "rms_norm") is None
    assert torch.allclose(fused.rms_norm(x, weight, 1e-6), F.rms_norm(x, (32,), weight, 1e-6))
    gate, up = x.chunk(2, dim=-1)
    assert torch.allclose(fused.silu_mul(x), F.silu(gate) * up)


def _teacher_forced(
    engine, prompt: list[int], tokens: list[int], fused_decode: bool
) -> torch.Tensor:
    for attention in (m for m in engine.stage.modules() if isinstance(m, GQAttention)):
        attention.fused_decode = fused_decode
    cache = engine.stage.new_cache()
    engine.prefill(prompt, cache)
    steps = [
        engine.stage(torch.tensor([t]), len(prompt) + i, cache)[-1] for i, t in enumerate(tokens)
    ]
    return torch.stack(steps).float()


def test_fused_attention_decodes_the_embedded_model_as_eager_attention(ops) -> None:
    """64 decode steps of the model's own text: in float32 the fused op's logits are within 1e-4
    of eager RoPE + cache + SDPA and pick the same tokens; in bfloat16 they are no farther from
    float32 (mean |difference|) than 1.25 times eager bfloat16 is."""
    exact = LocalModel.load(str(default_model_path()), "float32", 512)
    prompt = exact.codec.encode_chat([{"role": "user", "content": "Name three rivers in Europe."}])
    tokens = list(exact.engine.generate(prompt, SamplingParams(max_tokens=64)))
    eager, fused_run = (_teacher_forced(exact.engine, prompt, tokens, f) for f in (False, True))
    assert (fused_run - eager).abs().max().item() <= 1e-4
    assert torch.equal(fused_run.argmax(-1), eager.argmax(-1))
    half = LocalModel.load(str(default_model_path()), "bfloat16", 512).engine
    eager_error, fused_error = (
        (_teacher_forced(half, prompt, tokens, f) - eager).abs().mean().item()
        for f in (False, True)
    )
    assert fused_error <= 1.25 * eager_error, (fused_error, eager_error)
