"""Small building blocks: RMSNorm and the gated (SwiGLU, or Gemma's GELU-tanh) feed-forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seamline.model.fused import add_rms_norm, rms_norm, silu_mul
from seamline.model.linear import columns, linear, rows


def empty_param(*shape: int) -> nn.Parameter:
    """A placeholder with a shape and no storage (the meta device): the loader replaces every
    one, so a model larger than memory in float32 never reserves that much, even virtually."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = empty_param(dim)
        self.eps = eps
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, self(x + delta)) in one step."""
        return add_rms_norm(x, delta, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one [2*rows, hidden] matrix; act
    is silu, or ``gelu_tanh`` (Gemma)."""

    def __init__(self, hidden: int, rows: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_up = empty_param(2 * rows, hidden)
        self.down = empty_param(hidden, rows)
        self.rows = rows
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up)  # [T, 2*rows]
        if self.act == "silu":
            return linear(silu_mul(gate_up), self.down)
        gate, up = gate_up.chunk(2, dim=-1)
        return linear(self._act(gate) * up, self.down)

    def _act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")

    def rows_forward(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The partial output of intermediate rows [start, end) only (a quantized ``down``
        needs them on its block boundaries: see ``linear.granule``)."""
        if (start, end) == (0, self.rows):
            return self.forward(x)
        gate = linear(x, rows(self.gate_up, start, end))
        up = linear(x, rows(self.gate_up, self.rows + start, self.rows + end))
        return linear(self._act(gate) * up, columns(self.down, start, end))
