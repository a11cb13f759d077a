"""DeepSeek-V4's heavily compressed attention branch: every ``rate`` tokens become one entry.

Each token gives a candidate entry ``kv = x W_kv`` and a gate ``z = x W_z``. A window of
``rate`` tokens closes into one entry: the softmax over the window (per channel) of ``z`` plus
a learned per-position bias weighs the window's ``kv``; the sum is RMS-normed and its rope
slice turned at the window's first position. Tokens of a window not yet complete wait in the
state; entries only accumulate (windows do not overlap). A query at position p sees entry w
once its window [w*rate, (w+1)*rate) has ended at or before p.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seamline.model.layers import empty_param
from seamline.model.v4_parts import V4AttentionShape, turn, weighted_rms


class CompressorState:
    """A layer's compressor state for one sequence: the tokens of the open window, the
    entries so far."""

    def __init__(self) -> None:
        self.pending_kv: torch.Tensor | None = None  # [tokens < rate, head_dim]
        self.pending_gate: torch.Tensor | None = None
        self.entries: torch.Tensor | None = None  # [entries, head_dim]


class HeavyCompressor(nn.Module):
    def __init__(self, shape: V4AttentionShape, rate: int) -> None:
        super().__init__()
        self.shape, self.rate = shape, rate
        self.kv = empty_param(shape.head_dim, shape.hidden)
        self.gate = empty_param(shape.head_dim, shape.hidden)
        self.position_bias = empty_param(rate, shape.head_dim)
        self.kv_norm = empty_param(shape.head_dim)

    def forward(self, x: torch.Tensor, state: CompressorState) -> torch.Tensor:
        """Take the next tokens (x [T, hidden]); every entry so far [entries, head_dim]."""
        s, rate = self.shape, self.rate
        kv, gate = F.linear(x, self.kv), F.linear(x, self.gate)
        if state.pending_kv is not None:
            kv, gate = torch.cat([state.pending_kv, kv]), torch.cat([state.pending_gate, gate])  # type: ignore[list-item]
        done = state.entries.shape[0] if state.entries is not None else 0
        usable = kv.shape[0] // rate * rate
        state.pending_kv, state.pending_gate = kv[usable:], gate[usable:]
        windows, dim = usable // rate, kv.shape[1]
        weights = (gate[:usable].view(windows, rate, dim) + self.position_bias).softmax(dim=1, dtype=torch.float32)
        fresh = weighted_rms((kv[:usable].view(windows, rate, dim) * weights.to(kv.dtype)).sum(dim=1), self.kv_norm, s.eps)
        positions = torch.arange(done, done + windows) * rate
        fresh = turn(fresh.unsqueeze(1), positions, s.rope_dim, s.rope_theta)[:, 0]
        state.entries = fresh if state.entries is None else torch.cat([state.entries, fresh])
        return state.entries

    def visible(self, positions: torch.Tensor, entries: int) -> torch.Tensor:
        """[T, entries] bool: entry w is seen from position p once p >= (w + 1) * rate - 1."""
        return torch.arange(entries)[None, :] < ((positions + 1) // self.rate)[:, None]
