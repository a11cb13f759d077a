"""gpt-oss's experts as its checkpoints stack them, listed one tensor per expert and matrix.

transformers writes each layer's experts as stacked float tensors, ``mlp.experts.gate_up_proj``
[E, in, 2 * inter] (gate and up interleaved: gate at even columns, up at odd ones) with
``gate_up_proj_bias`` [E, 2 * inter], and ``down_proj`` likewise; the published checkpoints
store the matrices in MXFP4 instead, ``gate_up_proj_blocks`` [E, out, in / 32, 16] (two e2m1
values a byte, low nibble first) beside ``gate_up_proj_scales`` [E, out, in / 32] (UE8M0:
2 ** (byte - 127)). Either way a reader lists, per expert e, ``mlp.experts.{e}.gate_proj.weight``
(output rows first, as every other matrix; MXFP4 kept at its size as an fp4 ``ScaledTensor``),
``up_proj``, ``down_proj`` and their ``.bias``: the names llama.cpp's GGUF gives them too, so a
stage reads, and a fragment holds, only its experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from seamline.quant.scaled import ScaledTensor, scale_values

STACKED = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.((?:gate_up|down)_proj)(_bias|_blocks|_scales)?$"
)
FP4_BLOCK = 32  # MXFP4: weights per scale
HALVES = {"gate_up_proj": (("gate_proj", 0), ("up_proj", 1)), "down_proj": (("down_proj", None),)}


@dataclass(frozen=True)
class ExpertPart:
    """One expert's tensor: entry ``index`` of the stacked tensor ``stored`` (MXFP4: its blocks,
    with ``scales`` beside them), of its rows (outputs) from ``first`` in steps of 2 (None: all)."""

    stored: str
    index: int
    first: int | None = None
    scales: str | None = None


def split(
    files: dict[str, Path], experts: int
) -> tuple[dict[str, Path], dict[str, ExpertPart], dict[str, Path]]:
    """(``files`` with each stacked tensor replaced by its experts' names, those names' parts,
    the MXFP4 scales' files, which are read beside their blocks and not listed)."""
    listed: dict[str, Path] = {}
    parts: dict[str, ExpertPart] = {}
    scales: dict[str, Path] = {}
    for name, path in files.items():
        match = STACKED.match(name)
        if match is None:
            listed[name] = path
            continue
        prefix, matrix, kind = match.groups()
        if kind == "_scales":
            scales[name] = path
            continue
        suffix = ".bias" if kind == "_bias" else ".weight"
        for e in range(experts):
            for half, first in HALVES[matrix]:
                one = f"{prefix}.{e}.{half}{suffix}"
                listed[one] = path
                parts[one] = ExpertPart(
                    name, e, first, f"{prefix}.{matrix}_scales" if kind == "_blocks" else None
                )
    return listed, parts, scales


def expert_shape(part: ExpertPart, stacked: tuple[int, ...]) -> tuple[int, ...]:
    """One expert's shape from its stacked tensor's."""
    if part.scales is not None:
        shape: tuple[int, ...] = (stacked[1], stacked[2] * FP4_BLOCK)
    else:
        shape = stacked[1:] if len(stacked) == 2 else (stacked[2], stacked[1])
    return shape if part.first is None else (shape[0] // 2, *shape[1:])


def expert_tensor(
    part: ExpertPart, one: torch.Tensor, scales: torch.Tensor | None
) -> torch.Tensor | ScaledTensor:
    """One expert's entry of its stacked tensor (and of its MXFP4 scales) as listed."""
    rows = slice(None) if part.first is None else slice(part.first, None, 2)
    if part.scales is not None:
        assert scales is not None
        return ScaledTensor(
            "fp4",
            one[rows].reshape(-1, one.shape[1] * one.shape[2]).contiguous(),
            scale_values(scales[rows].contiguous()),
        )
    matrix = one.T if one.dim() == 2 else one
    return matrix[rows].contiguous()
