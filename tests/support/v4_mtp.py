"""DeepSeek-V4's multi-token-prediction layer in a test checkpoint (``mtp.0.*``, the original
checkpoint's spelling) and a float64 reference of DeepSeek's formula for its draft logits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.support.v4_reference import random_v4


@dataclass
class V4MtpLayer:
    """``block``: a one-layer transformers V4 (sliding attention, a routed MoE) whose layer is
    the MTP layer's block, its hyper-head and norm the layer's own, its head the model's;
    ``tensors``: the layer's own (e_proj, h_proj, enorm, hnorm)."""

    block: torch.nn.Module
    tensors: dict[str, torch.Tensor]


def silence_v4(model: torch.nn.Module) -> None:
    """Zero every attention output and expert down projection: each layer adds nothing, and
    every stream of the last residual is the input's embedding."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_b_proj" in name or "down_proj" in name:
                p.zero_()


def add_v4_mtp(
    model: torch.nn.Module, folder: Path, seed: int = 7, echo: bool = False
) -> V4MtpLayer:
    """Write a random MTP layer into the checkpoint at ``folder`` (its own file) and return it.
    With ``echo`` (over a silenced model) the layer computes what the model computes for the
    token after: its greedy drafts are right."""
    config = model.config.__class__(
        **{
            **model.config.to_dict(),
            "num_hidden_layers": 1,
            "layer_types": ["sliding_attention"],
            "mlp_layer_types": ["moe"],
        }
    )
    config._attn_implementation = "eager"
    block = random_v4(config, seed)
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(seed + 2)
    own = {
        "e_proj.weight": 0.3 * torch.randn(hidden, hidden, generator=gen),
        "h_proj.weight": 0.3 * torch.randn(hidden, hidden, generator=gen),
        "enorm.weight": 1.0 + 0.2 * torch.randn(hidden, generator=gen),
        "hnorm.weight": 1.0 + 0.2 * torch.randn(hidden, generator=gen),
    }
    with torch.no_grad():
        block.lm_head.weight.copy_(model.lm_head.weight)
        if echo:
            silence_v4(block)
            block.model.norm.weight.copy_(model.model.norm.weight)
            own.update(
                {
                    "e_proj.weight": torch.eye(hidden),
                    "h_proj.weight": torch.zeros(hidden, hidden),
                    "enorm.weight": torch.ones(hidden),
                }
            )
    block.save_pretrained(folder / "mtp-block")
    saved = load_file(folder / "mtp-block" / "model.safetensors")
    tensors = {"mtp.0." + k: v for k, v in own.items()}
    tensors.update(
        {
            "mtp.0." + k.removeprefix("model.layers.0."): v
            for k, v in saved.items()
            if k.startswith("model.layers.0.")
        }
    )
    head = {"hc_fn": "hc_head_fn", "hc_base": "hc_head_base", "hc_scale": "hc_head_scale"}
    tensors.update(
        {"mtp.0." + mine: saved["model.hc_head." + theirs] for theirs, mine in head.items()}
    )
    tensors["mtp.0.norm.weight"] = saved["model.norm.weight"]
    for path in (folder / "mtp-block").iterdir():
        path.unlink()
    (folder / "mtp-block").rmdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model-mtp.safetensors")
    return V4MtpLayer(block, own)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


@torch.no_grad()
def v4_mtp_reference_logits(
    model: torch.nn.Module, layer: V4MtpLayer, ids: torch.Tensor
) -> torch.Tensor:
    """float64: for each position t < T-1, the layer's logits from the model's last residual
    at t and the token at t+1, by the reference's formula (the block through transformers)."""
    main, block = model.double(), layer.block.double()
    for m in (main, block):  # the grouped matmul of transformers' experts takes no float64
        m.config._experts_implementation = "eager"
        for module in m.modules():
            if getattr(module, "config", None) is not None:
                module.config._experts_implementation = "eager"
    eps = model.config.rms_norm_eps
    captured: list[torch.Tensor] = []
    hook = main.model.hc_head.register_forward_pre_hook(lambda _, args: captured.append(args[0]))
    main(ids.unsqueeze(0), use_cache=False)
    hook.remove()
    h = captured[0][0, :-1]  # [T-1, hc, hidden]
    e = main.model.embed_tokens(ids[1:])
    t = {k: v.double() for k, v in layer.tensors.items()}
    x = (_rms(h, t["hnorm.weight"], eps) @ t["h_proj.weight"].T) + (
        _rms(e, t["enorm.weight"], eps) @ t["e_proj.weight"].T
    ).unsqueeze(1)
    swap = block.model.layers[0].register_forward_pre_hook(
        lambda _, args: (x.unsqueeze(0), *args[1:])
    )
    logits = block(ids[1:].unsqueeze(0), use_cache=False).logits[0]
    swap.remove()
    model.float(), layer.block.float()
    return logits
