"""DeepSeek-V4's compressed branches: every ``rate`` tokens of a layer become one entry.

Each token gives a candidate entry ``kv = x W_kv`` and a gate ``z = x W_z``. A window of
``rate`` tokens closes into one entry: the softmax over the window (per channel) of ``z`` plus
a learned per-position bias weighs the window's ``kv``; the sum is RMS-normed and its rope
slice turned at the window's first position. Tokens of a window not yet complete wait in the
state. A query at position p sees entry w once its window [w*rate, (w+1)*rate) has ended at
or before p.

``heavily_compressed_attention`` layers compress windows that do not overlap. The
``compressed_sparse_attention`` kind overlaps them (``overlap``): each token projects two
halves, and entry w softmax-weighs window w-1's first halves together with window w's second
halves (2 * rate slots), so the state keeps the last window's first halves. Its lightning
``Indexer`` compresses the same windows at its own width and picks, for each query, the
``top_k`` entries its heads score highest; the query sees only those.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seamline.model.layers import empty_param
from seamline.model.linear import linear
from seamline.model.v4_parts import V4AttentionShape, turn, weighted_rms


class CompressorState:
    """A compressor's state for one sequence: the tokens of the open window, the last closed
    window's first halves (overlapping windows), the entries so far."""

    def __init__(self) -> None:
        self.pending_kv: torch.Tensor | None = None  # [tokens < rate, width]
        self.pending_gate: torch.Tensor | None = None
        self.prior: tuple[torch.Tensor, torch.Tensor] | None = None  # ([rate, dim] kv, gate)
        self.entries: torch.Tensor | None = None  # [entries, dim]

    def nbytes(self) -> int:
        held = [self.pending_kv, self.pending_gate, self.entries, *(self.prior or ())]
        return sum(t.nbytes for t in held if t is not None)


class Compressor(nn.Module):
    def __init__(self, shape: V4AttentionShape, rate: int, dim: int, overlap: bool) -> None:
        super().__init__()
        self.shape, self.rate, self.dim, self.overlap = shape, rate, dim, overlap
        width = 2 * dim if overlap else dim
        self.kv = empty_param(width, shape.hidden)
        self.gate = empty_param(width, shape.hidden)
        self.position_bias = empty_param(rate, width)
        self.kv_norm = empty_param(dim)

    def forward(self, x: torch.Tensor, state: CompressorState) -> torch.Tensor:
        """Take the next tokens (x [T, hidden]); every entry so far [entries, dim]."""
        s, rate = self.shape, self.rate
        kv, gate = linear(x, self.kv), linear(x, self.gate)
        if state.pending_kv is not None and state.pending_gate is not None:
            kv, gate = torch.cat([state.pending_kv, kv]), torch.cat([state.pending_gate, gate])
        done = state.entries.shape[0] if state.entries is not None else 0
        usable = kv.shape[0] // rate * rate
        state.pending_kv, state.pending_gate = kv[usable:].clone(), gate[usable:].clone()
        windows, width = usable // rate, kv.shape[1]
        if windows == 0:
            state.entries = kv.new_zeros(0, self.dim) if state.entries is None else state.entries
            return state.entries
        kv, gate = kv[:usable].view(windows, rate, width), gate[:usable].view(windows, rate, width) + self.position_bias
        if self.overlap:
            kv, gate = self._overlapped(kv, gate, state)
        weights = gate.softmax(dim=1, dtype=torch.float32)
        fresh = weighted_rms((kv * weights.to(kv.dtype)).sum(dim=1), self.kv_norm, s.eps)
        fresh = turn(fresh.unsqueeze(1), torch.arange(done, done + windows) * rate, s.rope_dim, s.rope_theta)[:, 0]
        state.entries = fresh if state.entries is None else torch.cat([state.entries, fresh])
        return state.entries

    def _overlapped(self, kv: torch.Tensor, gate: torch.Tensor,
                    state: CompressorState) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """[windows, 2 * rate, dim]: the previous window's first halves, then this window's
        second halves. Before the first window nothing is there (zero, with weight 0)."""
        windows, rate, d = kv.shape[0], self.rate, self.dim
        wide_kv = kv.new_zeros(windows, 2 * rate, d)
        wide_gate = gate.new_full((windows, 2 * rate, d), float("-inf"))
        wide_kv[:, rate:], wide_gate[:, rate:] = kv[..., d:], gate[..., d:]
        wide_kv[1:, :rate], wide_gate[1:, :rate] = kv[:-1, :, :d], gate[:-1, :, :d]
        if state.prior is not None:
            wide_kv[0, :rate], wide_gate[0, :rate] = state.prior
        state.prior = kv[-1, :, :d].clone(), gate[-1, :, :d].clone()
        return wide_kv, wide_gate

    def ended(self, positions: torch.Tensor, entries: int) -> torch.Tensor:
        """[T, entries] bool: entry w is seen from position p once p >= (w + 1) * rate - 1."""
        return torch.arange(entries)[None, :] < ((positions + 1) // self.rate)[:, None]


class Indexer(nn.Module):
    """The lightning indexer: sum over its heads h of w_h(x) * relu(q_h . k_entry), top-k."""

    def __init__(self, shape: V4AttentionShape, rate: int, heads: int, dim: int, top_k: int) -> None:
        super().__init__()
        self.heads, self.dim, self.top_k = heads, dim, top_k
        self.compressor = Compressor(shape, rate, dim, overlap=True)
        self.q_b = empty_param(heads * dim, shape.q_lora_rank)
        self.weights = empty_param(heads, shape.hidden)

    def forward(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
                state: CompressorState) -> torch.Tensor:  # fmt: skip
        """[T, entries] bool: the entries each query may see (ended, and among its top k)."""
        s = self.compressor.shape
        keys = self.compressor(x, state)
        q = linear(q_residual, self.q_b).view(x.shape[0], self.heads, self.dim)
        q = turn(q, positions, s.rope_dim, s.rope_theta)
        scores = F.relu(torch.einsum("thd,ed->the", q.float(), keys.float())) * self.dim**-0.5
        weights = linear(x, self.weights).float() * self.heads**-0.5  # [T, heads]
        ended = self.compressor.ended(positions, keys.shape[0])
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1).masked_fill(~ended, float("-inf"))
        picked = scores.topk(min(self.top_k, keys.shape[0]), dim=-1).indices  # [T, k]
        chosen = torch.zeros_like(ended).scatter_(1, picked, True)
        return chosen & ended
