"""DeepSeek-V4's shared pieces: an attention layer's shape, its RMS norms and interleaved RoPE."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def weighted_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    f = x.float()
    return (weight.float() * (f * torch.rsqrt(f.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def turn(
    x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float, back: bool = False
) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``rope_dim`` channels of ``x`` [T, heads, dim] (``back``:
    the inverse rotation), in float32."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=x.device) / rope_dim)
    )
    angles = positions.float()[:, None] * inv_freq  # [T, rope_dim / 2]
    cos = angles.cos().repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = angles.sin().repeat_interleave(2, dim=-1).unsqueeze(1) * (-1.0 if back else 1.0)
    plain, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    swapped = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([plain, (rope * cos + swapped * sin).to(x.dtype)], dim=-1)
