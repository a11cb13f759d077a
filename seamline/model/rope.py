"""Rotary position embedding: inverse frequencies for each scaling variant in config.json.

Mirrors the published formulas (default, linear, dynamic at its base length, llama3, yarn).
``RotaryTable`` caches cos/sin per position; its ``attention_factor`` scales both (yarn).
"""

from __future__ import annotations

import math

import torch

from seamline.config import RopeScaling
from seamline.errors import ConfigError


def inverse_frequencies(
    dim: int, theta: float, scaling: RopeScaling, max_positions: int
) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [dim/2], attention_factor) for a rotary dimension ``dim``."""
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    kind = scaling.rope_type
    if kind in ("default", "dynamic"):  # dynamic NTK equals default up to the trained length
        return base, 1.0
    if kind == "linear":
        return base / scaling.factor, 1.0
    if kind == "llama3":
        return _llama3(base, scaling), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, max_positions)
    raise ConfigError(f"unsupported rope_type {kind!r}")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_len = s.original_max_position_embeddings or 8192
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: RopeScaling, max_positions: int) -> tuple[torch.Tensor, float]:
    old_len = s.original_max_position_embeddings or max_positions
    factor = s.factor
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention_factor = yarn_mscale(factor, s.mscale) / yarn_mscale(factor, s.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low: float = correction_dim(s.beta_fast)
    high: float = correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


class RotaryTable:
    """cos/sin per position, grown on demand; rows are [positions, dim] (halves repeated)."""

    def __init__(self, dim: int, theta: float, scaling: RopeScaling, max_positions: int) -> None:
        self.inv_freq, self.attention_factor = inverse_frequencies(
            dim, theta, scaling, max_positions
        )
        self.cos = torch.empty(0, dim)
        self.sin = torch.empty(0, dim)

    def move_to(self, device: torch.device) -> None:
        """Compute and keep the tables on ``device`` (a stage's)."""
        self.inv_freq = self.inv_freq.to(device)
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def lookup(
        self, start: int, count: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [start, start+count), each [count, dim], in ``dtype``."""
        cos, sin = self.tables(start + count, dtype)
        return cos[start : start + count], sin[start : start + count]

    def tables(self, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos and sin tables [positions >= end, dim] in ``dtype`` (for a kernel that
        picks its row itself: no slicing op per call)."""
        if end > self.cos.shape[0]:
            self._grow(max(end, 2 * self.cos.shape[0], 256))
        if self.cos.dtype != dtype:  # converted once, not per call
            self.cos, self.sin = self.cos.to(dtype), self.sin.to(dtype)
        return self.cos, self.sin

    def _grow(self, length: int) -> None:
        positions = torch.arange(length, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(positions, self.inv_freq)  # [length, dim/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [length, dim]
        dtype = self.cos.dtype
        self.cos = (angles.cos() * self.attention_factor).to(dtype)
        self.sin = (angles.sin() * self.attention_factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, dim]; cos/sin: [T, dim] (half-split layout, as Hugging Face Llama)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin
