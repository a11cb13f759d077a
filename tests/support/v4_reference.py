"""A small random DeepSeek-V4 checkpoint, written by transformers as a user would find it.

Every attention kind (sliding, compressed sparse, heavily compressed), hash-routed and top-k
routed experts, 4 hyper-connection streams, and a window and compression rates that a prompt
of a dozen tokens crosses. Every tensor is drawn afresh (sinks, biases, tables too), so a
part left at its initial value cannot hide."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def v4_config(vocab: int = 96, layers: int = 3, **overrides: Any) -> Any:
    from transformers import DeepseekV4Config

    fields: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=16,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        hc_mult=4,
        sliding_window=4,
        partial_rotary_factor=0.5,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=4,
        index_head_dim=8,
        index_topk=2,
        layer_types=[LAYER_TYPES[i % 3] for i in range(layers)],
        mlp_layer_types=["hash_moe" if i == 0 else "moe" for i in range(layers)],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 3},
        max_position_embeddings=4096,
    )
    fields.update(overrides)
    config = DeepseekV4Config(**fields)
    config._attn_implementation = "eager"
    return config


def random_v4(config: Any, seed: int = 0) -> Any:
    """transformers' DeepseekV4ForCausalLM in float32 with every tensor drawn at random."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("tid2eid"):
                tensor.copy_(
                    torch.randint(0, config.n_routed_experts, tensor.shape, generator=generator)
                )
            elif tensor.is_floating_point():
                tensor.copy_(
                    torch.randn(tensor.shape, generator=generator)
                    * (1.0 if tensor.dim() == 1 else 0.2)
                )
    return model


def save_random_v4(folder: Path, config: Any | None = None, seed: int = 0) -> Any:
    """A random V4 saved as a Hugging Face folder; returns the reference model."""
    model = random_v4(config if config is not None else v4_config(), seed)
    model.save_pretrained(folder)
    return model


def with_tokenizer(folder: Path) -> Path:
    """The embedded model's tokenizer and chat template beside the weights (text round-trips)."""
    from seamline.app import default_model_path
    from seamline.weights.gguf import chat_template_from_gguf, tokenizer_from_gguf

    tokenizer_from_gguf(default_model_path()).save(str(folder / "tokenizer.json"))
    template = chat_template_from_gguf(default_model_path())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder


def reference_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.unsqueeze(0), use_cache=False).logits[0]
