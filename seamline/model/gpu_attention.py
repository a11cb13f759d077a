"""One-token attention rows of many sequences in two Triton kernels on a GPU: the CUDA forms of
the C++ ops ``decode_attention`` and ``decode_attention_batch`` (same arguments, same answers).

Eager torch takes about fifteen kernels per sequence and layer for a decode row (RoPE, the cache
writes, SDPA); at 64 sequences a step would launch twenty thousand. Here a step's rows, whatever
their sequences, take two launches per layer: ``_rope_write`` turns q and k by each row's
position and writes k and v into that row's own cache, then ``_attend`` runs one program per
(row, head) over that cache up to the row's position (within the window, where there is one),
with an online softmax in float32. Each sequence keeps its own cache buffers (``LayerKV``): the
rows' buffers reach the kernels as a table of addresses, positions and capacities, one small
copy per layer. Rows of one speculative window see each other's keys: the writes all land
before any row attends.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_KEYS = 64


@triton.jit
def _rope_write(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    table_ptr,
    q_out_ptr,
    rows,
    H: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)  # query heads, then KV heads (each writes its key and its value)
    pos = tl.load(table_ptr + r)
    capacity = tl.load(table_ptr + 3 * rows + r)
    d = tl.arange(0, D)
    row = qkv_ptr + r * (H + 2 * HKV) * D
    x = tl.load(row + h * D + d).to(tl.float32)
    partner = tl.load(row + h * D + (d + D // 2) % D).to(tl.float32)
    turned = x * tl.load(cos_ptr + pos * D + d).to(tl.float32) + tl.where(
        d < D // 2, -partner, partner
    ) * tl.load(sin_ptr + pos * D + d).to(tl.float32)
    if h < H:
        tl.store(q_out_ptr + (r * H + h) * D + d, turned)
    else:
        g = h - H
        keys = tl.load(table_ptr + rows + r).to(tl.pointer_type(qkv_ptr.dtype.element_ty))
        values = tl.load(table_ptr + 2 * rows + r).to(tl.pointer_type(qkv_ptr.dtype.element_ty))
        at = (g * capacity + pos) * D + d
        tl.store(keys + at, turned.to(qkv_ptr.dtype.element_ty))
        tl.store(values + at, tl.load(row + (H + HKV + g) * D + d))


@triton.jit
def _attend(
    q_ptr,
    table_ptr,
    out_ptr,
    rows,
    window,
    scale,
    H: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    g = h // (H // HKV)  # SDPA's grouping: consecutive query heads share a KV head
    pos = tl.load(table_ptr + r)
    keys = tl.load(table_ptr + rows + r).to(tl.pointer_type(out_ptr.dtype.element_ty))
    values = tl.load(table_ptr + 2 * rows + r).to(tl.pointer_type(out_ptr.dtype.element_ty))
    capacity = tl.load(table_ptr + 3 * rows + r)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (r * H + h) * D + d) * scale
    first = tl.maximum(pos - window + 1, 0)
    best = float("-inf")
    total = 0.0
    acc = tl.zeros((D,), tl.float32)
    for start in range(
        first, pos + 1, BLOCK
    ):  # bounds read from the table: a replayed graph stays right
        n = start + tl.arange(0, BLOCK)
        seen = n <= pos
        at = (g * capacity + n)[:, None] * D + d[None, :]
        k = tl.load(keys + at, mask=seen[:, None], other=0.0).to(tl.float32)
        score = tl.where(seen, tl.sum(k * q[None, :], axis=1), float("-inf"))
        top = tl.maximum(best, tl.max(score, axis=0))
        weight = tl.exp(score - top)
        fade = tl.exp(best - top)
        v = tl.load(values + at, mask=seen[:, None], other=0.0).to(tl.float32)
        total = total * fade + tl.sum(weight, axis=0)
        acc = acc * fade + tl.sum(weight[:, None] * v, axis=0)
        best = top
    tl.store(out_ptr + (r * H + h) * D + d, (acc / total).to(out_ptr.dtype.element_ty))


def supported(head_dim: int) -> bool:
    """The kernels take whole heads of a power-of-two width."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def decode_attention_batch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    positions: list[int],
    heads: int,
    kv_heads: int,
    window: int = 0,
) -> torch.Tensor:
    """Rows ``qkv`` [R, (H + 2 Hkv) D], row i at ``positions[i]`` of the sequence whose caches
    [Hkv, capacity, D] are ``k_caches[i]``, ``v_caches[i]`` -> attention outputs [R, H D]."""
    dim = k_caches[0].shape[-1]
    table = torch.tensor(
        [
            positions,
            [k.data_ptr() for k in k_caches],
            [v.data_ptr() for v in v_caches],
            [k.shape[1] for k in k_caches],
        ],
        dtype=torch.int64,
    ).to(qkv.device, non_blocking=True)
    return attend_with_table(
        qkv.contiguous(), cos.contiguous(), sin.contiguous(), table, heads, kv_heads, dim, window
    )


def attend_with_table(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    table: torch.Tensor,
    heads: int,
    kv_heads: int,
    dim: int,
    window: int = 0,
) -> torch.Tensor:
    """The two kernels over rows whose positions and caches a device ``table`` [4, R] int64 holds
    (position, keys' address, values' address, capacity): what a captured graph replays."""
    rows = qkv.shape[0]
    turned = torch.empty(rows, heads, dim, dtype=torch.float32, device=qkv.device)
    _rope_write[(rows, heads + kv_heads)](
        qkv, cos, sin, table, turned, rows, H=heads, HKV=kv_heads, D=dim
    )
    out = torch.empty(rows, heads * dim, dtype=qkv.dtype, device=qkv.device)
    _attend[(rows, heads)](
        turned,
        table,
        out,
        rows,
        window or 1 << 30,
        dim**-0.5,
        H=heads,
        HKV=kv_heads,
        D=dim,
        BLOCK=BLOCK_KEYS,
    )  # no window: every position from 0
    return out


def decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int,
    heads: int,
    kv_heads: int,
    window: int = 0,
) -> torch.Tensor:
    """One sequence's one row: ``decode_attention_batch`` of one."""
    return decode_attention_batch(
        qkv, cos, sin, [k_cache], [v_cache], [pos], heads, kv_heads, window
    )
