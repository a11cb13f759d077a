"""Multi-head latent attention (MLA) for DeepSeek-V2 and DeepSeek-V3.

Keys and values come from one compressed latent per token: ``kv_a`` gives the latent
(``kv_lora_rank`` wide, RMS-normed) and a rope key ``k_pe`` shared by every head; ``kv_b``
expands the latent into per-head ``k_nope`` and ``v``. Queries split into a no-position part
and a rope part. Only the rope parts are rotated.

The KV cache holds the latent and the rotated ``k_pe`` (slot k: [1, S, kv_lora_rank], slot
v: [1, S, rope_dim]), not the expanded per-head keys and values: for DeepSeek-V3 that is
576 numbers per token and layer instead of 128 heads x 320 = 40960 (71x less memory), which
is what lets a long context fit on ordinary machines. Attention then either re-expands the
cached latents (cheap for long prefill chunks) or folds ``kv_b`` into the query and output
("absorbed", cheap for decode); ``_prefer_absorbed`` picks the one with fewer flops.

Under ``Ownership.shard`` a rank holds only its heads' rows of q_b (or q) and kv_b and their
columns of o; kv_a, q_a and the latent norms are replicated, and so is the latent cache
(it has no head dimension). The output is a partial sum over heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from seamline.config import ModelConfig
from seamline.errors import ConfigError
from seamline.model.attention import causal_mask
from seamline.model.cache import LayerKV, Span
from seamline.model.layers import RMSNorm, empty_param
from seamline.model.linear import linear
from seamline.model.rope import RotaryTable, apply_rotary, yarn_mscale
from seamline.ownership import Ownership
from seamline.quant import matmul

# DeepSeek's latent norms use the default epsilon, not config.rms_norm_eps (reference code
# and transformers both build them as RMSNorm(rank)).
LATENT_NORM_EPS = 1e-6


def softmax_scale(config: ModelConfig) -> float:
    """qk_head_dim^-0.5, times mscale^2 under yarn with ``mscale_all_dim`` (as DeepSeek does)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    s = config.rope_scaling
    if s.rope_type != "default" and s.mscale_all_dim:
        mscale = yarn_mscale(s.factor, s.mscale_all_dim)
        scale *= mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairwise-interleaved rope dims (x0, x1, x2, x3, ...) -> half-split (x0, x2, ..., x1, x3, ...).

    Rotating the de-interleaved vector in the half-split layout rotates each (x2i, x2i+1)
    pair by frequency i, as DeepSeek's complex multiplication does; the output order differs
    from V2's (interleaved) by one permutation applied to q and k alike, so q.k is unchanged.
    """
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryTable, own: Ownership) -> None:
        super().__init__()
        if config.attention_bias:
            raise ConfigError("MLA attention has no bias tensors: attention_bias must be false")
        if not config.kv_lora_rank or not config.qk_rope_head_dim:
            raise ConfigError("MLA attention needs kv_lora_rank > 0 and qk_rope_head_dim > 0")
        h0, h1 = own.head_range(config.num_heads)
        self.heads = h1 - h0  # owned heads
        self.nope = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.rank = config.kv_lora_rank
        hidden, q_rows = config.hidden_size, self.heads * (self.nope + self.rope_dim)
        self.q_a: nn.Parameter | None = None
        self.q_a_norm: RMSNorm | None = None
        self.q_b: nn.Parameter | None = None
        self.q: nn.Parameter | None = None
        if config.q_lora_rank:
            self.q_a = empty_param(config.q_lora_rank, hidden)
            self.q_a_norm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b = empty_param(q_rows, config.q_lora_rank)
        else:  # DeepSeek-V2-Lite: one full-rank query projection
            self.q = empty_param(q_rows, hidden)
        self.kv_a = empty_param(self.rank + self.rope_dim, hidden)
        self.kv_a_norm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b = empty_param(self.heads * (self.nope + self.v_dim), self.rank)
        self.o = empty_param(hidden, self.heads * self.v_dim)
        self.rope = rope
        # V2's reference always rotates interleaved pairs (complex multiply); V3 has a flag.
        self.interleaved = config.rope_interleave or config.family == "deepseek_v2"
        self.scale = softmax_scale(config)

    def forward(self, x: torch.Tensor, spans: Sequence[Span], layer: int) -> torch.Tensor:
        """x [N, hidden]: the rows of every span; projections for all rows at once, attention
        per span over its own sequence's latent cache of ``layer``."""
        q = self._query(x).view(x.shape[0], self.heads, self.nope + self.rope_dim)
        latent, k_pe = linear(x, self.kv_a).split((self.rank, self.rope_dim), dim=-1)
        latent = self.kv_a_norm(latent)  # [N, C]
        if len(spans) == 1 and not spans[0].rowwise and not matmul.ROWS_ALONE:
            out = self._attend(q, latent, k_pe, spans[0].start, spans[0].cache.layer(layer))
        else:  # a speculative window's rows (every row, computed alone: ``matmul.ROWS_ALONE``)
            # one at a time, as one-row steps compute them
            pieces = [
                (s, a, b)
                for s in spans
                for a, b in (
                    [(r, r + 1) for r in range(s.offset, s.end)]
                    if s.rowwise or matmul.ROWS_ALONE
                    else [(s.offset, s.end)]
                )
            ]
            out = torch.cat(
                [
                    self._attend(
                        q[a:b], latent[a:b], k_pe[a:b], s.start + a - s.offset, s.cache.layer(layer)
                    )
                    for s, a, b in pieces
                ]
            )
        return linear(out.reshape(x.shape[0], self.heads * self.v_dim), self.o)  # out: [N, H, V]

    def _attend(
        self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, start: int, kv: LayerKV
    ) -> torch.Tensor:
        """One sequence's rows (q [T, H, N+R], latent [T, C], k_pe [T, R]) -> [T, H, V]."""
        count = q.shape[0]
        q_nope, q_pe = q.split((self.nope, self.rope_dim), dim=-1)  # [T, H, N], [T, H, R]
        cos, sin = self.rope.lookup(start, count, q.dtype)
        q_pe = apply_rotary(self._layout(q_pe), cos, sin)  # [T, H, R]
        k_pe = apply_rotary(self._layout(k_pe.unsqueeze(1)), cos, sin)  # [T, 1, R]
        latents, k_pes = kv.update(
            latent.unsqueeze(0), k_pe.transpose(0, 1), start
        )  # [1, S, C], [1, S, R]
        mask = causal_mask(start, count, device=q.device)  # [T, S] or None
        if self._prefer_absorbed(count):
            return self._attend_absorbed(q_nope, q_pe, latents[0], k_pes[0], mask)
        return self._attend_expanded(q_nope, q_pe, latents[0], k_pes[0], mask)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q is not None:
            return linear(x, self.q)
        assert self.q_a is not None and self.q_a_norm is not None and self.q_b is not None
        return linear(self.q_a_norm(linear(x, self.q_a)), self.q_b)  # [T, H*(N+R)]

    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        return deinterleave(x) if self.interleaved else x

    def _prefer_absorbed(self, count: int) -> bool:
        """Absorbed costs ~S*H*T*(2C) flops, expanded ~S*H*(C*(N+V) + T*(N+V)): pick the lower."""
        return count * (2 * self.rank - self.nope - self.v_dim) < self.rank * (
            self.nope + self.v_dim
        )

    def _attend_expanded(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latents: torch.Tensor,
        k_pes: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Expand every cached latent into per-head k/v, then ordinary attention. -> [T, H, V]"""
        seq = latents.shape[0]
        kv = linear(latents, self.kv_b).view(seq, self.heads, self.nope + self.v_dim)
        k_nope, values = kv.split((self.nope, self.v_dim), dim=-1)  # [S, H, N], [S, H, V]
        k_rot = k_pes.unsqueeze(1).expand(seq, self.heads, self.rope_dim)  # [S, H, R]
        keys = torch.cat((k_nope, k_rot), dim=-1)  # [S, H, N+R]
        query = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, N+R]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),  # [1, H, T, N+R]
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=self.scale,
        )  # [1, H, T, V]
        return out.squeeze(0).transpose(0, 1)

    def _attend_absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latents: torch.Tensor,
        k_pes: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attend in latent space: q_nope.(W_uk c) = (W_uk^T q_nope).c, out = W_uv (p.c). -> [T, H, V]"""
        w = self.kv_b.view(self.heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w.split((self.nope, self.v_dim), dim=1)  # [H, N, C], [H, V, C]
        q_lat = torch.einsum("thn,hnc->htc", q_nope, w_uk)  # [H, T, C]
        scores = torch.matmul(q_lat, latents.t())  # [H, T, S]
        scores = scores + torch.matmul(q_pe.transpose(0, 1), k_pes.t())
        scores = scores * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(latents.dtype)
        out_lat = torch.matmul(probs, latents)  # [H, T, C]
        return torch.einsum("htc,hvc->thv", out_lat, w_uv)
