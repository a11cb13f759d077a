"""DeepSeek-V4's attention: a sliding window, and the compressed branches of two layer kinds.

One key/value head shared by every query head, read as both key and value (shared-KV
multi-query attention). Queries go through a low-rank projection (``q_a``, normed, ``q_b``)
and a weightless per-head RMS norm; the shared KV is normed too. RoPE turns the trailing
``rope_dim`` channels of each head, pairs interleaved, and the output's rope slice is turned
back at the query's position (the values carried the keys' rotation). Each head has a learned
sink: one more logit in its softmax that takes weight and gives no value. The heads' output is
projected in ``o_groups`` groups to ``o_lora_rank`` each (``o_a``), then mixed (``o_b``).

A query at position p sees the keys at positions (p - window, p]: the cache keeps the last
``window - 1`` keys. A compressed layer (``v4_compress``) also sees its compressor's entries
whose windows end at or before p: all of them (``heavily_compressed_attention``), or those its
lightning indexer picks for it (``compressed_sparse_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from seamline.config import V4_REWIND_REACH
from seamline.model.layers import empty_param
from seamline.model.linear import linear, to_float
from seamline.model.v4_compress import Compressor, CompressorState, Indexer
from seamline.model.v4_parts import V4AttentionShape, turn, unweighted_rms, weighted_rms


@dataclass(frozen=True)
class Compression:
    rate: int  # tokens per entry
    sparse: bool = False  # overlapping windows and an indexer (compressed_sparse_attention)
    index_heads: int = 0
    index_dim: int = 0
    index_top_k: int = 0


class SlidingCache:
    """The last ``window - 1`` shared keys (already normed and turned), ``V4_REWIND_REACH``
    more to take back a speculative window's rejected positions, and how many came; a
    compressed layer's compressor keeps its state here too."""

    def __init__(self) -> None:
        self.kv: torch.Tensor | None = None  # [kept, head_dim]
        self.length = 0
        self.compressed = CompressorState()
        self.indexed = CompressorState()

    def nbytes(self) -> int:
        window = self.kv.nbytes if self.kv is not None else 0
        return window + self.compressed.nbytes() + self.indexed.nbytes()


class V4Attention(nn.Module):
    def __init__(self, shape: V4AttentionShape, compression: Compression | None = None) -> None:
        """``compression``: a compressed layer's branch (None: sliding only)."""
        super().__init__()
        s = self.shape = shape
        c = compression
        self.compressor = Compressor(shape, c.rate, s.head_dim, c.sparse) if c is not None else None
        self.indexer = (
            Indexer(shape, c.rate, c.index_heads, c.index_dim, c.index_top_k)
            if c and c.sparse
            else None
        )
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
        if start < cache.length:
            self._rewind(cache, start)  # the drafts from ``start`` on were rejected
        if start != cache.length:
            raise ValueError(
                f"the cache holds {cache.length} positions; this step starts at {start}"
            )
        positions = torch.arange(start, start + tokens, device=x.device)
        q_residual = weighted_rms(linear(x, self.q_a), self.q_a_norm, s.eps)
        q = linear(q_residual, self.q_b)
        q = turn(
            unweighted_rms(q.view(tokens, s.heads, s.head_dim), s.eps),
            positions,
            s.rope_dim,
            s.rope_theta,
        )
        kv = weighted_rms(linear(x, self.kv), self.kv_norm, s.eps).view(tokens, 1, s.head_dim)
        kv = turn(kv, positions, s.rope_dim, s.rope_theta)[:, 0]  # [T, head_dim]
        keys = kv if cache.kv is None else torch.cat([cache.kv, kv])
        visible = self._window_mask(positions, start - (keys.shape[0] - tokens), keys.shape[0])
        if self.compressor is not None:
            entries = self.compressor(x, cache.compressed)
            keys = torch.cat([keys, entries])
            if self.indexer is not None:
                seen = self.indexer(x, q_residual, positions, cache.indexed)
            else:
                seen = self.compressor.ended(positions, entries.shape[0])
            visible = torch.cat([visible, seen], dim=1)
        out = self._attend(q, keys, visible)
        window = keys[: keys.shape[0] - (0 if self.compressor is None else entries.shape[0])]
        kept = window[-(max(s.window - 1, 0) + V4_REWIND_REACH) :]
        cache.kv, cache.length = kept.clone(), cache.length + tokens  # not a view holding every key
        out = turn(out, positions, s.rope_dim, s.rope_theta, back=True)
        grouped = out.reshape(tokens, s.o_groups, -1).transpose(
            0, 1
        )  # [G, T, heads * head_dim / G]
        dense = (
            self.o_a if isinstance(self.o_a, torch.Tensor) else to_float(self.o_a, x.dtype)
        )  # fp8 in V4's files
        o_a = dense.view(s.o_groups, s.o_lora_rank, -1).transpose(
            1, 2
        )  # a narrower checkpoint keeps its dtype
        mixed = torch.bmm(grouped.to(o_a.dtype), o_a).to(x.dtype)
        return linear(mixed.transpose(0, 1).reshape(tokens, -1), self.o_b)

    def _rewind(self, cache: SlidingCache, position: int) -> None:
        """Take back the positions from ``position`` on, within the keys and rows kept."""
        back, kept = cache.length - position, cache.kv.shape[0] if cache.kv is not None else 0
        if cache.length - kept > max(0, position - (self.shape.window - 1)):
            raise ValueError(
                f"the cache holds {cache.length} positions; it cannot go back {back} to {position}"
            )
        if cache.kv is not None:
            cache.kv = cache.kv[: kept - back].clone()
        cache.length = position
        if self.compressor is not None:
            self.compressor.rewind(cache.compressed, position)
        if self.indexer is not None:
            self.indexer.compressor.rewind(cache.indexed, position)

    def _window_mask(self, positions: torch.Tensor, first_key: int, keys: int) -> torch.Tensor:
        """[T, keys] bool: which of the window's keys each query sees."""
        distance = (
            positions[:, None]
            - torch.arange(first_key, first_key + keys, device=positions.device)[None, :]
        )
        return (distance >= 0) & (distance < self.shape.window)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Softmax over the visible keys and the head's sink; the shared keys are the values."""
        s = self.shape
        scores = torch.einsum("thd,kd->htk", q, keys) * s.head_dim**-0.5  # [heads, T, keys]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        sinks = self.sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, q.shape[0], 1)
        logits = torch.cat([scores, sinks], dim=-1)
        probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
        return torch.einsum("htk,kd->thd", probs.to(keys.dtype), keys)  # [T, heads, head_dim]
