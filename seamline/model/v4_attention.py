"""DeepSeek-V4's sliding-window attention (the ``sliding_attention`` layers).

One key/value head shared by every query head, read as both key and value (shared-KV
multi-query attention). Queries go through a low-rank projection (``q_a``, normed, ``q_b``)
and a weightless per-head RMS norm; the shared KV is normed too. RoPE turns the trailing
``rope_dim`` channels of each head, pairs interleaved, and the output's rope slice is turned
back at the query's position (the values carried the keys' rotation). Each head has a learned
sink: one more logit in its softmax that takes weight and gives no value. The heads' output is
projected in ``o_groups`` groups to ``o_lora_rank`` each (``o_a``), then mixed (``o_b``).

A query at position p sees the keys at positions (p - window, p]: the cache keeps the last
``window - 1`` keys. The compressed branches of the other two layer kinds are not here yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from seamline.model.layers import empty_param


@dataclass(frozen=True)
class V4AttentionShape:
    hidden: int
    heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rope_dim: int
    rope_theta: float
    window: int
    eps: float


class SlidingCache:
    """The last ``window - 1`` shared keys (already normed and turned) and how many came."""

    def __init__(self) -> None:
        self.kv: torch.Tensor | None = None  # [kept, head_dim]
        self.length = 0


def _weighted_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    f = x.float()
    return (weight.float() * (f * torch.rsqrt(f.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def turn(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float, back: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``rope_dim`` channels of ``x`` [T, heads, dim] (``back``:
    the inverse rotation), in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    angles = positions.float()[:, None] * inv_freq  # [T, rope_dim / 2]
    cos = angles.cos().repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = angles.sin().repeat_interleave(2, dim=-1).unsqueeze(1) * (-1.0 if back else 1.0)
    plain, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    swapped = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([plain, (rope * cos + swapped * sin).to(x.dtype)], dim=-1)


class SlidingAttention(nn.Module):
    def __init__(self, shape: V4AttentionShape) -> None:
        super().__init__()
        s = self.shape = shape
        self.q_a = empty_param(s.q_lora_rank, s.hidden)
        self.q_a_norm = empty_param(s.q_lora_rank)
        self.q_b = empty_param(s.heads * s.head_dim, s.q_lora_rank)
        self.kv = empty_param(s.head_dim, s.hidden)
        self.kv_norm = empty_param(s.head_dim)
        self.o_a = empty_param(s.o_groups * s.o_lora_rank, s.heads * s.head_dim // s.o_groups)
        self.o_b = empty_param(s.hidden, s.o_groups * s.o_lora_rank)
        self.sinks = empty_param(s.heads)

    def forward(self, x: torch.Tensor, start: int, cache: SlidingCache) -> torch.Tensor:
        """x [T, hidden] at positions [start, start + T) -> [T, hidden]; ``cache`` grows by T."""
        s, tokens = self.shape, x.shape[0]
        if start != cache.length:
            raise ValueError(f"the cache holds {cache.length} positions; this step starts at {start}")
        positions = torch.arange(start, start + tokens)
        q = F.linear(_weighted_rms(F.linear(x, self.q_a), self.q_a_norm, s.eps), self.q_b)
        q = turn(_unweighted_rms(q.view(tokens, s.heads, s.head_dim), s.eps), positions, s.rope_dim, s.rope_theta)
        kv = _weighted_rms(F.linear(x, self.kv), self.kv_norm, s.eps).view(tokens, 1, s.head_dim)
        kv = turn(kv, positions, s.rope_dim, s.rope_theta)[:, 0]  # [T, head_dim]
        keys = kv if cache.kv is None else torch.cat([cache.kv, kv])
        out = self._attend(q, keys, positions, start - (keys.shape[0] - tokens))
        cache.kv, cache.length = keys[-(s.window - 1) :] if s.window > 1 else keys[:0], cache.length + tokens
        out = turn(out, positions, s.rope_dim, s.rope_theta, back=True)
        grouped = out.reshape(tokens, s.o_groups, -1).transpose(0, 1)  # [G, T, heads * head_dim / G]
        mixed = torch.bmm(grouped, self.o_a.view(s.o_groups, s.o_lora_rank, -1).transpose(1, 2))
        return F.linear(mixed.transpose(0, 1).reshape(tokens, -1), self.o_b)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, first_key: int) -> torch.Tensor:
        """Softmax over the window's keys and the head's sink; the shared keys are the values."""
        s = self.shape
        scores = torch.einsum("thd,kd->htk", q, keys) * s.head_dim**-0.5  # [heads, T, keys]
        key_positions = torch.arange(first_key, first_key + keys.shape[0])
        distance = positions[:, None] - key_positions[None, :]
        scores = scores.masked_fill(((distance < 0) | (distance >= s.window))[None], float("-inf"))
        sinks = self.sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, q.shape[0], 1)
        logits = torch.cat([scores, sinks], dim=-1)
        probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
        return torch.einsum("htk,kd->thd", probs.to(keys.dtype), keys)  # [T, heads, head_dim]
