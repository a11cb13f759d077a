"""MXFP4 as gpt-oss's published checkpoints store their experts: e2m1 values two a byte (low
nibble first) in blocks of 32 with a UE8M0 scale each, written here from float weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [*lead, rows, cols] -> (blocks [*lead, rows, cols / 32, 16] uint8, scales [*lead, rows,
    cols / 32] uint8, the float weights they hold)."""
    blocks = w.float().unflatten(-1, (-1, 32))  # [..., G, 32]
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(amax / 6.0))  # amax / 2**e <= 6, the largest e2m1 value
    scaled = blocks / exponent.exp2()
    index = (scaled.abs().unsqueeze(-1) - E2M1).abs().argmin(dim=-1)  # nearest magnitude
    nibble = index + 8 * (scaled < 0)
    held = E2M1[index] * scaled.sign() * exponent.exp2()
    packed = (nibble[..., 0::2] | (nibble[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent[..., 0] + 127).to(torch.uint8), held.flatten(-2)


def write_mxfp4_experts(model: torch.nn.Module, folder: Path) -> None:
    """Rewrite the saved checkpoint's stacked expert matrices as MXFP4 blocks and scales, and set
    ``model``'s experts to the weights those hold (the reference for the quantized file)."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        output_rows_first = tensors.pop(name).transpose(1, 2)  # [E, out, in]
        blocks, scales, held = to_mxfp4(output_rows_first)
        tensors[name + "_blocks"], tensors[name + "_scales"] = (
            blocks.contiguous(),
            scales.contiguous(),
        )
        with torch.no_grad():
            model.get_parameter(name).copy_(held.transpose(1, 2))
    save_file(tensors, path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["self_attn", "router", "embed", "lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(config))
