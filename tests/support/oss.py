"""A small random gpt-oss checkpoint (``gpt_oss``), written by transformers, its biases and sinks
made non-zero."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from tests.support.reference import save_random_model

OSS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 150000.0,
        "truncate": False,
    },
)


def oss_config(truncate: bool = False, **overrides: Any) -> Any:
    """gpt-oss's config; ``truncate=True`` is YaRN as a GGUF of it runs (llama.cpp's ramp)."""
    rope = {**OSS["rope_parameters"], "truncate": truncate}
    return transformers.GptOssConfig(**{**OSS, "rope_parameters": rope, **overrides})


def save_oss(folder: Path, truncate: bool = False) -> Any:
    model = save_random_model(oss_config(truncate), folder)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # transformers starts biases and sinks at zero: make them count
        for name, p in model.named_parameters():
            if "sinks" in name or name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)
    return model
