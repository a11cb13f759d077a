"""Upcycle a dense Llama-style checkpoint into an exactly equivalent Mixtral checkpoint.

Every layer's feed-forward is copied into ``experts`` identical experts under a random
router with top-k = ``top_k``. Mixtral renormalises the top-k softmax weights to sum to one,
so the layer is ``sum_k w_k * ffn(x) = ffn(x)``, the dense feed-forward (up to rounding),
whatever the router picks. Attention, norms and embeddings are copied as they are. The
result is a real-weights MoE for testing the expert split (DESIGN.md, "upcycling").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from seamline.model.linear import to_float
from seamline.weights.loader import open_source

DENSE = ("gate_proj", "up_proj", "down_proj")
MIXTRAL = ("w1", "w3", "w2")  # Mixtral's names for gate, up, down
# config.json keys that carry over unchanged from the dense model (Llama spelling); rope is
# converted explicitly, the feed-forward becomes the experts' width.
CARRIED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
)


def mixtral_config(dense: dict[str, Any], experts: int, top_k: int) -> dict[str, Any]:
    """The Mixtral config.json dict of a dense Llama config upcycled to ``experts`` experts."""
    from transformers import MixtralConfig

    if (
        dense.get("model_type") != "llama"
        or dense.get("attention_bias")
        or dense.get("rope_scaling")
    ):
        raise ValueError(
            f"only plain Llama configs (no bias, no rope scaling) upcycle here: {dense}"
        )
    theta = dense.get("rope_theta", (dense.get("rope_parameters") or {}).get("rope_theta"))
    config = MixtralConfig(
        **{k: dense[k] for k in CARRIED if k in dense},
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
        sliding_window=None,  # Llama attends to the whole context
        hidden_act="silu",
        router_jitter_noise=0.0,
    )
    out = config.to_dict()
    out["architectures"] = ["MixtralForCausalLM"]
    return out


def upcycle(
    dense_path: Path, folder: Path, experts: int = 4, top_k: int = 2, seed: int = 0
) -> Path:
    """Write ``folder`` (config.json + model.safetensors, fp32) from the dense checkpoint at
    ``dense_path`` (a GGUF file or a Hugging Face folder, read through seamline's loader)."""
    source = open_source(dense_path)
    dense = source.config_dict()
    config = mixtral_config(dense, experts, top_k)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(source.names()):
        tensor = to_float(source.get(name), torch.float32).contiguous()  # quantized: dequantised
        prefix, dot, tail = name.partition(".mlp.")
        if not dot:  # attention, norms, embeddings (and lm_head if untied): as they are
            tensors[name] = tensor
            continue
        which = tail.removesuffix(".weight")  # gate_proj / up_proj / down_proj
        w = MIXTRAL[DENSE.index(which)]
        for e in range(experts):  # identical copies; safetensors refuses shared storage
            tensors[f"{prefix}.block_sparse_moe.experts.{e}.{w}.weight"] = tensor.clone()
        if which == "gate_proj":  # one router per layer: [experts, hidden]
            router = torch.randn(experts, dense["hidden_size"], generator=gen)
            tensors[f"{prefix}.block_sparse_moe.gate.weight"] = router
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
