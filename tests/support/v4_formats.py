"""A DeepSeek-V4 checkpoint as V4's own files store it: fp8 weights with UE8M0 block scales,
routed experts in packed fp4 (e2m1) with a scale per 32 weights of a row, under the original
names (``layers.0.attn.wq_a.weight`` beside ``layers.0.attn.wq_a.scale``), and
``quantization_config`` declaring it. Built here from a float checkpoint; the reference model
gets the weights as transformers' own dequantisation (``Fp8Dequantize``) reads them back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP8_BLOCK = (8, 8)  # V4 uses 128 x 128; the small test model's matrices need smaller blocks
FP4_BLOCK = 32
FP8_TARGETS = (
    ".attn.wq_a.",
    ".attn.wq_b.",
    ".attn.wkv.",
    ".attn.wo_a.",
    ".attn.wo_b.",
    ".shared_experts.",
)


def _power_of_two_scales(amax: torch.Tensor, top: float) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-12) / top))).to(torch.float8_e8m0fnu)


def to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bm, bn = FP8_BLOCK
    rows, cols = w.shape
    blocks = w.reshape(rows // bm, bm, cols // bn, bn)
    scales = _power_of_two_scales(blocks.abs().amax(dim=(1, 3)), 448.0)
    full = scales.float().repeat_interleave(bm, 0).repeat_interleave(bn, 1)
    return (w / full).to(torch.float8_e4m3fn), scales


def to_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    scales = _power_of_two_scales(
        w.reshape(rows, cols // FP4_BLOCK, FP4_BLOCK).abs().amax(dim=-1), 6.0
    )
    scaled = w / scales.float().repeat_interleave(FP4_BLOCK, 1)
    codes = (scaled.abs().unsqueeze(-1) - E2M1).abs().argmin(dim=-1) | ((scaled < 0).long() << 3)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scales


def original_name(name: str) -> str:
    """transformers' name -> the original V4 checkpoint's."""
    fixed = {
        "model.embed_tokens.weight": "embed.weight",
        "model.norm.weight": "norm.weight",
        "model.hc_head.hc_fn": "hc_head_fn",
        "model.hc_head.hc_base": "hc_head_base",
        "model.hc_head.hc_scale": "hc_head_scale",
    }
    return fixed.get(name, name.removeprefix("model."))


def quantize_folder(folder: Path, to: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Write ``folder``'s float V4 checkpoint to ``to`` in V4's formats and names; returns the
    quantized (values, scales) by transformers' name."""
    state = load_file(str(folder / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    quantized = {}
    for name, tensor in state.items():
        ours = original_name(name)
        if ".ffn.experts." in name:
            quantized[name] = to_fp4(tensor)
        elif name.endswith(".weight") and any(t in name for t in FP8_TARGETS):
            quantized[name] = to_fp8(tensor)
        else:
            out[ours] = tensor
            continue
        out[ours], out[ours.removesuffix(".weight") + ".scale"] = quantized[name]
    to.mkdir(parents=True)
    save_file(out, str(to / "model.safetensors"))
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": list(FP8_BLOCK),
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
        "activation_scheme": "dynamic",
    }
    (to / "config.json").write_text(json.dumps(config))
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        if (folder / extra).is_file():
            (to / extra).write_text((folder / extra).read_text())
    return quantized


def dequantized_by_transformers(
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    op = Fp8Dequantize(None)
    return {
        name: op._dequantize_one(values, scales, output_dtype=torch.float32)
        for name, (values, scales) in quantized.items()
    }
