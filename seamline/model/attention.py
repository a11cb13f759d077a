"""Grouped-query attention for the Llama family (Llama, SmolLM2, Qwen2 biases, Qwen3 q/k norm,
GLM-4.5's RoPE on half of each head).

q, k and v are one fused projection; RoPE is applied to q and k in one call. A one-token step on
CPU runs RoPE, the cache write and attention as one C++ op (``decode_attention``) when the kernels
are built: in eager torch the same step is ~35 small ops a layer, and their dispatch would set
the decode speed. A batched step's one-token rows go to one call for all their sequences
(``decode_attention_batch``). Under
``Ownership.shard`` a rank holds only its query heads and the KV heads they read (q/k/v rows,
o columns); its output is a partial sum over heads, which the Block's gate all-reduces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from seamline.config import ModelConfig
from seamline.model.cache import LayerKV, Span
from seamline.model.fused import op_for
from seamline.model.gpu_static import attend_with_table, static_table
from seamline.model.layers import RMSNorm, empty_param
from seamline.model.linear import linear
from seamline.model.rope import RotaryTable, apply_rotary
from seamline.ownership import Ownership
from seamline.quant import matmul


def causal_mask(
    start: int, count: int, window: int = 0, device: torch.device | None = None, first: int = 0
) -> torch.Tensor | None:
    """Boolean mask [count, start+count-first] for a chunk after ``start`` cached positions over
    keys from position ``first``; with a ``window``, a query at i sees only keys (i - window, i],
    as transformers' sliding window."""
    if count == 1 and (not window or start - first < window):
        return None
    keys = torch.arange(first, start + count, device=device)
    queries = torch.arange(start, start + count, device=device).unsqueeze(1)
    visible = keys <= queries
    return visible & (keys > queries - window) if window else visible


def attend_with_sinks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, its sink, that takes weight and adds
    no value (gpt-oss): q [T, H, D], keys/values [Hkv, S, D], mask [T, S] -> [T, H, D]."""
    heads, group = q.shape[1], q.shape[1] // keys.shape[0]
    keys, values = (
        keys.repeat_interleave(group, dim=0),
        values.repeat_interleave(group, dim=0),
    )  # [H, S, D]
    scores = torch.einsum("thd,hsd->hts", q, keys) * (scale or q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(heads, 1, 1).expand(heads, scores.shape[1], 1)
    weights = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("hts,hsd->thd", weights.to(values.dtype), values)


def _uneven_kv_map(q0: int, q1: int, k0: int, group: int) -> torch.Tensor | None:
    """Local KV head of each owned query head, or None when SDPA's own grouping (``H/Hkv``
    consecutive query heads per KV head) already gets it right."""
    wanted = [(q // group) - k0 for q in range(q0, q1)]
    kv_heads = wanted[-1] + 1
    per = (q1 - q0) // kv_heads
    if (q1 - q0) % kv_heads == 0 and wanted == [h // per for h in range(q1 - q0)]:
        return None
    return torch.tensor(wanted, dtype=torch.long)


class GQAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, rope: RotaryTable, own: Ownership, window: int = 0
    ) -> None:
        """``window``: a sliding window's keys (0: every position); its cache is a ring that keeps
        the window (``LayerKV.window_update``), and the mask hides what lies behind it."""
        super().__init__()
        self.window = window
        self.rotary_dim = config.rotary_dim or config.head_dim  # GLM-4.5 turns half of each head
        self.scale = config.attention_scale or None  # Gemma 3: query_pre_attn_scalar ** -0.5
        q0, q1 = own.head_range(config.num_heads)
        k0, k1 = own.kv_head_range(config.num_heads, config.num_kv_heads)
        self.heads = q1 - q0  # owned query heads
        self.kv_heads = k1 - k0  # owned KV heads (replicated across ranks when Hkv < world)
        self.head_dim = config.head_dim
        rows = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.qkv = empty_param(rows, config.hidden_size)
        self.qkv_bias = empty_param(rows) if config.attention_bias else None
        self.o = empty_param(config.hidden_size, self.heads * self.head_dim)
        # gpt-oss: the output's bias (added once: by rank 0 of a group) and a sink logit per head
        self.o_bias = (
            empty_param(config.hidden_size)
            if config.attention_out_bias and own.shard[0] == 0
            else None
        )
        self.sinks = empty_param(self.heads) if config.attention_sinks else None
        self.kv_map = _uneven_kv_map(q0, q1, k0, config.num_heads // config.num_kv_heads)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rope = rope
        # the fused op covers the plain layout: no q/k norm, SDPA's own head grouping, whole-head RoPE
        # (a sliding layer's ring is read by position runs here, not by the fused ops)
        whole = self.rotary_dim == self.head_dim and self.scale is None and self.sinks is None
        self.fused_decode = self.q_norm is None and self.kv_map is None and whole and not window
        self.gpu_decode = (
            self.fused_decode and self.head_dim >= 16 and not self.head_dim & (self.head_dim - 1)
        )

    def _decode_op(self, qkv: torch.Tensor, name: str) -> Callable[..., torch.Tensor] | None:
        """The fused decode op ``name`` for these rows' device (the GPU's takes power-of-two heads)."""
        return (
            op_for(qkv, name) if (self.gpu_decode if qkv.is_cuda else self.fused_decode) else None
        )

    def _decode(
        self, op: Callable[..., torch.Tensor], qkv: torch.Tensor, start: int, kv: LayerKV
    ) -> torch.Tensor:
        cos, sin = self.rope.tables(start + 1, qkv.dtype)
        keys, values = kv.reserve(self.kv_heads, self.head_dim, start + 1, qkv.dtype, qkv.device)
        return op(
            qkv, cos, sin, keys, values, start, self.heads, self.kv_heads, self.window
        )  # [1, H * D]

    def forward(self, x: torch.Tensor, spans: Sequence[Span], layer: int) -> torch.Tensor:
        """x [N, hidden]: the rows of every span; one projection for all rows, attention per
        span over its own sequence's cache of ``layer``."""
        qkv = linear(x, self.qkv, self.qkv_bias)  # [N, (H + 2*Hkv) * D]
        if (
            table := static_table(layer)
        ) is not None:  # a decode step being captured (``runtime/cuda_graphs.py``)
            cos, sin = self.rope.tables(1, qkv.dtype)  # grown to the context before the capture
            out = attend_with_table(
                qkv, cos, sin, table, self.heads, self.kv_heads, self.head_dim, self.window
            )
        elif len(spans) == 1 and not spans[0].rowwise and not matmul.ROWS_ALONE:
            out = self._attend(qkv, spans[0].start, spans[0].cache.layer(layer))
        else:
            out = self._attend_spans(qkv, spans, layer)
        return linear(out, self.o, self.o_bias)

    def _attend_spans(self, qkv: torch.Tensor, spans: Sequence[Span], layer: int) -> torch.Tensor:
        """Several sequences' rows: the one-token rows and speculative windows at the head of the
        step (where the scheduler puts decode rows) in one fused call, row by row; every other
        span on its own. Rows computed alone (``matmul.ROWS_ALONE``, a checked mesh): every row
        as a decode row, so a prompt's rows are the same in whatever chunks it came."""
        ones = 0
        while ones < len(spans) and (
            spans[ones].count == 1 or spans[ones].rowwise or matmul.ROWS_ALONE
        ):
            ones += 1
        head = [
            (s, s.start + j) for s in spans[:ones] for j in range(s.count)
        ]  # (span, position) per row
        op = self._decode_op(qkv, "decode_attention_batch") if len(head) > 1 else None
        if op is None:
            return torch.cat([self._attend_span(qkv, s, layer) for s in spans])
        cos, sin = self.rope.tables(max(position for _, position in head) + 1, qkv.dtype)
        kv = [
            s.cache.layer(layer).reserve(
                self.kv_heads, self.head_dim, s.start + s.count, qkv.dtype, qkv.device
            )
            for s, _ in head
        ]
        rows = head[-1][0].end
        out = op(
            qkv[:rows],
            cos,
            sin,
            [k for k, _ in kv],
            [v for _, v in kv],
            [position for _, position in head],
            self.heads,
            self.kv_heads,
            self.window,
        )
        rest = [self._attend_span(qkv, s, layer) for s in spans[ones:]]
        return torch.cat([out, *rest]) if rest else out

    def _attend_span(self, qkv: torch.Tensor, span: Span, layer: int) -> torch.Tensor:
        kv = span.cache.layer(layer)
        if not span.rowwise and not matmul.ROWS_ALONE:
            return self._attend(qkv[span.offset : span.end], span.start, kv)
        return torch.cat(
            [
                self._attend(qkv[row : row + 1], span.start + row - span.offset, kv)
                for row in range(span.offset, span.end)
            ]
        )

    def _attend(self, qkv: torch.Tensor, start: int, kv: LayerKV) -> torch.Tensor:
        """One sequence's rows [T, (H + 2*Hkv) * D] at positions from ``start`` -> [T, H * D]."""
        count = qkv.shape[0]
        if count == 1 and (op := self._decode_op(qkv, "decode_attention")) is not None:
            return self._decode(op, qkv, start, kv)
        qkv = qkv.view(count, self.heads + 2 * self.kv_heads, self.head_dim)
        qk, v = qkv.split((self.heads + self.kv_heads, self.kv_heads), dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split((self.heads, self.kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        cos, sin = self.rope.lookup(start, count, qkv.dtype)
        if self.rotary_dim < self.head_dim:  # the leading dims turn; the rest pass as they are
            turned = apply_rotary(qk[..., : self.rotary_dim], cos, sin)
            qk = torch.cat((turned, qk[..., self.rotary_dim :]), dim=-1)
        else:
            qk = apply_rotary(qk, cos, sin)  # [T, H + Hkv, D]
        q, k = qk.split((self.heads, self.kv_heads), dim=1)
        if self.window:  # its cache is a ring of its window's positions (``model/cache.py``)
            keys, values, first = kv.window_update(
                k.transpose(0, 1), v.transpose(0, 1), start, self.window
            )
        else:
            (keys, values), first = (
                kv.update(k.transpose(0, 1), v.transpose(0, 1), start),
                0,
            )  # [Hkv, S, D]
        if self.kv_map is not None:  # an uneven share: one KV row per query head
            keys, values = keys.index_select(0, self.kv_map), values.index_select(0, self.kv_map)
        if self.sinks is not None:
            mask = causal_mask(start, count, self.window, q.device, first)
            out = attend_with_sinks(q, keys, values, mask, self.sinks, self.scale)
            return out.reshape(count, self.heads * self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, T, D]
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=causal_mask(start, count, self.window, q.device, first),
            enable_gqa=self.kv_map is None and self.kv_heads != self.heads,
            scale=self.scale,
        )  # [1, H, T, D]
        return out.transpose(1, 2).reshape(count, self.heads * self.head_dim)  # a view when T == 1
