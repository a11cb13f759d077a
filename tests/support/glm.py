"""A small random GLM-4.5-style MoE checkpoint (``glm4_moe``), written by transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import transformers

from tests.support.deepseek import randomize

GLM = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    attention_bias=True,
    partial_rotary_factor=0.5,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)


def save_glm(folder: Path, qk_norm: bool = True, seed: int = 0) -> Any:
    config = transformers.Glm4MoeConfig(**GLM, use_qk_norm=qk_norm)
    model = transformers.Glm4MoeForCausalLM(config).eval()
    randomize(model, seed)  # a non-zero correction bias, norms away from 1
    model.save_pretrained(folder)
    return model
