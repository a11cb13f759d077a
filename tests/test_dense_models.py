"""Dense families against transformers: logits within 1e-4 (fp32) over prefill + decode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from seamline.weights.loader import load_stage, open_source
from tests.reference import random_ids, reference_logits, save_random_model, seamline_logits, split_logits

ATOL = 1e-4
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip


def _configs() -> dict[str, Any]:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {
        "llama": LlamaConfig(**SMALL, tie_word_embeddings=False),
        "llama-tied": LlamaConfig(**SMALL, tie_word_embeddings=True),
        "llama-mha": LlamaConfig(**{**SMALL, "num_key_value_heads": 4}),
        "llama3-rope": LlamaConfig(**SMALL, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64), rope_theta=500000.0),  # fmt: skip
        "linear-rope": LlamaConfig(**SMALL, rope_scaling=dict(rope_type="linear", factor=2.0)),
        "yarn-rope": LlamaConfig(**SMALL, rope_scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=128)),  # fmt: skip
        "qwen2": Qwen2Config(**SMALL, tie_word_embeddings=False),
        "qwen3": Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=True),
    }


@pytest.mark.parametrize("name", list(_configs()))
def test_logits_match_transformers(name: str, tmp_path: Path) -> None:
    model = save_random_model(_configs()[name], tmp_path)
    stage = load_stage(open_source(tmp_path))
    ids = random_ids(256)
    expected = reference_logits(model, ids)
    got = seamline_logits(stage, ids)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("cut", [1, 2])
def test_stage_split_equals_whole(cut: int, tmp_path: Path) -> None:
    model = save_random_model(_configs()["qwen2"], tmp_path)
    ids = random_ids(256)
    whole = seamline_logits(load_stage(open_source(tmp_path)), ids)
    torch.testing.assert_close(split_logits(tmp_path, cut, ids), whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(whole, reference_logits(model, ids), atol=ATOL, rtol=0)


def test_vocab_shards_concatenate_to_full_head(tmp_path: Path) -> None:
    from seamline.ownership import Ownership

    save_random_model(_configs()["llama-tied"], tmp_path)
    source = open_source(tmp_path)
    ids = random_ids(256)
    whole = seamline_logits(load_stage(source), ids)
    halves = [load_stage(source, Ownership(layers=(0, 3), vocab=v)) for v in ((0, 100), (100, 256))]
    assert halves[0].head is not None and halves[0].head.shape == (100, 64)
    parts = [seamline_logits(stage, ids) for stage in halves]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=0)


def test_stage_allocates_only_owned_layers(tmp_path: Path) -> None:
    from seamline.ownership import Ownership

    save_random_model(_configs()["llama"], tmp_path)
    stage = load_stage(open_source(tmp_path), Ownership(layers=(1, 2)))
    assert list(stage.layers.keys()) == ["1"]
    assert stage.embed is None and stage.head is None
