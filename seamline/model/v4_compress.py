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

from seamline.config import V4_REWIND_REACH
from seamline.model.layers import empty_param
from seamline.model.linear import linear
from seamline.model.v4_parts import V4AttentionShape, turn, weighted_rms


class CompressorState:
    """A compressor's state for one sequence: its latest tokens' candidates and gates (the open
    window's, the last closed window's for overlapping windows, and ``V4_REWIND_REACH`` more,
    so that a speculative window's rejected positions can be taken back), and the entries."""

    def __init__(self) -> None:
        self.count = 0  # positions taken
        self.tail_kv: torch.Tensor | None = None  # [rows, width]: positions [count - rows, count)
        self.tail_gate: torch.Tensor | None = None
        self.entries: torch.Tensor | None = None  # [entries, dim]

    def nbytes(self) -> int:
        held = [self.tail_kv, self.tail_gate, self.entries]
        return sum(t.nbytes for t in held if t is not None)

    def tail_start(self) -> int:
        """The position of the tail's first row."""
        return self.count - (self.tail_kv.shape[0] if self.tail_kv is not None else 0)


class Compressor(nn.Module):
    def __init__(self, shape: V4AttentionShape, rate: int, dim: int, overlap: bool) -> None:
        super().__init__()
        self.shape, self.rate, self.dim, self.overlap = shape, rate, dim, overlap
        width = 2 * dim if overlap else dim
        self.kv = empty_param(width, shape.hidden)
        self.gate = empty_param(width, shape.hidden)
        self.position_bias = empty_param(rate, width)
        self.kv_norm = empty_param(dim)

    def kept_rows(self) -> int:
        """The tail a state keeps: the open window, the last closed one when windows overlap,
        and the positions a rewind may take back."""
        return (2 if self.overlap else 1) * self.rate - 1 + V4_REWIND_REACH

    def forward(self, x: torch.Tensor, state: CompressorState) -> torch.Tensor:
        """Take the next tokens (x [T, hidden]); every entry so far [entries, dim]."""
        s, rate = self.shape, self.rate
        kv, gate = linear(x, self.kv), linear(x, self.gate)
        first = state.tail_start()  # the position of rows[0]
        if state.tail_kv is not None and state.tail_gate is not None:
            kv, gate = torch.cat([state.tail_kv, kv]), torch.cat([state.tail_gate, gate])
        done = state.entries.shape[0] if state.entries is not None else 0
        state.count += x.shape[0]
        windows, width = state.count // rate - done, kv.shape[1]
        if windows > 0:
            begin = done * rate - first
            wkv = kv[begin : begin + windows * rate].view(windows, rate, width)
            wgate = (
                gate[begin : begin + windows * rate].view(windows, rate, width) + self.position_bias
            )
            if self.overlap:
                before = (kv[begin - rate : begin], gate[begin - rate : begin]) if done else None
                wkv, wgate = self._overlapped(wkv, wgate, before)
            weights = wgate.softmax(dim=1, dtype=torch.float32)
            fresh = weighted_rms((wkv * weights.to(wkv.dtype)).sum(dim=1), self.kv_norm, s.eps)
            fresh = turn(
                fresh.unsqueeze(1),
                torch.arange(done, done + windows, device=fresh.device) * rate,
                s.rope_dim,
                s.rope_theta,
            )[:, 0]
            state.entries = fresh if state.entries is None else torch.cat([state.entries, fresh])
        elif state.entries is None:
            state.entries = kv.new_zeros(0, self.dim)
        keep = self.kept_rows()  # copies: not views holding a long prompt's rows
        state.tail_kv, state.tail_gate = kv[-keep:].clone(), gate[-keep:].clone()
        return state.entries

    def rewind(self, state: CompressorState, position: int) -> None:
        """Take back the positions from ``position`` on: the entries of windows not ended
        before it, and their rows."""
        closed = position // self.rate
        needed = (
            max(0, closed - (1 if self.overlap else 0)) * self.rate
        )  # rows the next window reads
        if not needed >= state.tail_start() or position > state.count:
            raise ValueError(
                f"a compressor at {state.count} keeps positions from {state.tail_start()}: "
                f"it cannot go back to {position}"
            )
        assert (
            state.tail_kv is not None and state.tail_gate is not None and state.entries is not None
        )
        rows = state.tail_kv.shape[0] - (state.count - position)
        state.tail_kv, state.tail_gate = (
            state.tail_kv[:rows].clone(),
            state.tail_gate[:rows].clone(),
        )
        state.entries, state.count = state.entries[:closed].clone(), position

    def _overlapped(
        self, kv: torch.Tensor, gate: torch.Tensor, before: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[windows, 2 * rate, dim]: the previous window's first halves (``before``: the rows
        of the window before the first, with no position bias yet), then this window's second
        halves. Before the first window nothing is there (zero, with weight 0)."""
        windows, rate, d = kv.shape[0], self.rate, self.dim
        wide_kv = kv.new_zeros(windows, 2 * rate, d)
        wide_gate = gate.new_full((windows, 2 * rate, d), float("-inf"))
        wide_kv[:, rate:], wide_gate[:, rate:] = kv[..., d:], gate[..., d:]
        wide_kv[1:, :rate], wide_gate[1:, :rate] = kv[:-1, :, :d], gate[:-1, :, :d]
        if before is not None:
            wide_kv[0, :rate], wide_gate[0, :rate] = (
                before[0][:, :d],
                (before[1] + self.position_bias)[:, :d],
            )
        return wide_kv, wide_gate

    def ended(self, positions: torch.Tensor, entries: int) -> torch.Tensor:
        """[T, entries] bool: entry w is seen from position p once p >= (w + 1) * rate - 1."""
        return (
            torch.arange(entries, device=positions.device)[None, :]
            < ((positions + 1) // self.rate)[:, None]
        )


class Indexer(nn.Module):
    """The lightning indexer: sum over its heads h of w_h(x) * relu(q_h . k_entry), top-k."""

    def __init__(
        self, shape: V4AttentionShape, rate: int, heads: int, dim: int, top_k: int
    ) -> None:
        super().__init__()
        self.heads, self.dim, self.top_k = heads, dim, top_k
        self.compressor = Compressor(shape, rate, dim, overlap=True)
        self.q_b = empty_param(heads * dim, shape.q_lora_rank)
        self.weights = empty_param(heads, shape.hidden)

    def forward(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        state: CompressorState,
    ) -> torch.Tensor:
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
