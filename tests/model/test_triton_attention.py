"""The GPU's decode attention (``model/gpu_attention.py``) gives the eager path's answers: rows of
several sequences at different positions in one call, a speculative window's rows seeing each
other's keys, a sliding window. On CUDA where there is one, else in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seamline.config import RopeScaling
from seamline.model.rope import RotaryTable, apply_rotary

pytest.importorskip("triton", reason="triton is a test dependency (pip install -e '.[test]')")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV_HEADS, DIM = 4, 2, 16


def _reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: int,
    window: int,
) -> torch.Tensor:
    """One row at ``pos`` over a sequence whose cache holds [0, pos) in ``keys``/``values``."""
    row = qkv.view(HEADS + 2 * KV_HEADS, DIM).float()
    turned = apply_rotary(
        row[: HEADS + KV_HEADS].unsqueeze(0), cos[pos : pos + 1].float(), sin[pos : pos + 1].float()
    )[0]
    k = torch.cat([keys[:, :pos].float(), turned[HEADS:].unsqueeze(1)], dim=1)  # [Hkv, pos + 1, D]
    v = torch.cat([values[:, :pos].float(), row[HEADS + KV_HEADS :].unsqueeze(1)], dim=1)
    first = max(0, pos - window + 1) if window else 0
    out = F.scaled_dot_product_attention(
        turned[:HEADS].unsqueeze(1).unsqueeze(0),
        k[:, first:].unsqueeze(0),
        v[:, first:].unsqueeze(0),
        enable_gqa=True,
    )
    return out.reshape(HEADS * DIM)


@pytest.mark.parametrize("window", [0, 5])
def test_triton_decode_attention_over_several_sequences_equals_eager(window: int) -> None:
    from seamline.model.gpu_attention import decode_attention_batch

    torch.manual_seed(0)
    rope = RotaryTable(DIM, 10000.0, RopeScaling(), 256)
    rope.move_to(torch.device(DEVICE))
    cos, sin = rope.tables(64, torch.float32)
    positions = [3, 17, 9]
    caches = [
        (
            torch.randn(KV_HEADS, 32, DIM, device=DEVICE),
            torch.randn(KV_HEADS, 32, DIM, device=DEVICE),
        )
        for _ in positions
    ]
    before = [(k.clone(), v.clone()) for k, v in caches]
    qkv = torch.randn(len(positions), (HEADS + 2 * KV_HEADS) * DIM, device=DEVICE)
    got = decode_attention_batch(
        qkv,
        cos,
        sin,
        [k for k, _ in caches],
        [v for _, v in caches],
        positions,
        HEADS,
        KV_HEADS,
        window,
    )
    for i, pos in enumerate(positions):
        want = _reference(qkv[i], cos, sin, before[i][0], before[i][1], pos, window)
        torch.testing.assert_close(got[i].float(), want, rtol=1e-4, atol=1e-4)
        assert torch.equal(
            caches[i][1][:, pos], qkv[i].view(-1, DIM)[HEADS + KV_HEADS :]
        )  # the value written


def test_triton_decode_attention_window_rows_see_each_other() -> None:
    """Two rows of one sequence at positions 6 and 7: the second attends over the first's key."""
    from seamline.model.gpu_attention import decode_attention_batch

    torch.manual_seed(1)
    rope = RotaryTable(DIM, 10000.0, RopeScaling(), 256)
    rope.move_to(torch.device(DEVICE))
    cos, sin = rope.tables(64, torch.float32)
    keys, values = (
        torch.randn(KV_HEADS, 16, DIM, device=DEVICE),
        torch.randn(KV_HEADS, 16, DIM, device=DEVICE),
    )
    qkv = torch.randn(2, (HEADS + 2 * KV_HEADS) * DIM, device=DEVICE)
    got = decode_attention_batch(
        qkv, cos, sin, [keys, keys], [values, values], [6, 7], HEADS, KV_HEADS
    )
    want_first = _reference(qkv[0], cos, sin, keys, values, 6, 0)
    want_second = _reference(
        qkv[1], cos, sin, keys, values, 7, 0
    )  # keys[:, 6] now holds row 0's key
    torch.testing.assert_close(got[0].float(), want_first, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1].float(), want_second, rtol=1e-4, atol=1e-4)
