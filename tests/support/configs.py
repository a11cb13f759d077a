"""Small model configs and checkpoints the tests build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import transformers  # the reference: a test dependency, never skipped

from seamline.app import default_model_path
from seamline.weights.loader import open_source
from seamline.weights.source import TensorSource
from tests.support.deepseek import build_deepseek
from tests.support.reference import save_random_model
from tests.support.v4_reference import save_random_v4

SMALL = dict(
    vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2
)  # the MoE families'
DENSE_SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def mixtral_config() -> Any:
    return transformers.MixtralConfig(
        **SMALL,
        intermediate_size=128,
        num_hidden_layers=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    )


def qwen3_moe_config(norm_topk_prob: bool) -> Any:
    return transformers.Qwen3MoeConfig(
        **SMALL,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=[1],
    )


def dense_configs() -> dict[str, Any]:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {
        "llama": LlamaConfig(**DENSE_SMALL, tie_word_embeddings=False),
        "llama-tied": LlamaConfig(**DENSE_SMALL, tie_word_embeddings=True),
        "llama-mha": LlamaConfig(**{**DENSE_SMALL, "num_key_value_heads": 4}),
        "llama3-rope": LlamaConfig(
            **DENSE_SMALL,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            rope_theta=500000.0,
        ),
        "linear-rope": LlamaConfig(
            **DENSE_SMALL, rope_scaling=dict(rope_type="linear", factor=2.0)
        ),
        "yarn-rope": LlamaConfig(
            **DENSE_SMALL,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128),
        ),
        "qwen2": Qwen2Config(**DENSE_SMALL, tie_word_embeddings=False),
        "qwen3": Qwen3Config(**DENSE_SMALL, head_dim=32, tie_word_embeddings=True),
    }


def checkpoint_folder(kind: str, folder: Path) -> Path:
    """A random checkpoint of ``kind`` written into ``folder`` (its folder), or the embedded GGUF."""
    if kind == "dense":
        save_random_model(dense_configs()["llama"], folder)
    elif kind == "mixtral":
        save_random_model(mixtral_config(), folder)
    elif kind == "deepseek_v3":
        folder = build_deepseek(folder, "v3")[1]
    elif kind == "deepseek_v4":
        save_random_v4(folder)
    else:
        return default_model_path()
    return folder


def checkpoint_source(kind: str, folder: Path) -> TensorSource:
    """A random checkpoint of ``kind`` written to ``folder``, or the embedded GGUF, to load from."""
    return open_source(checkpoint_folder(kind, folder))
