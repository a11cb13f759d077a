"""Gemma 3 as llama.cpp writes it to GGUF (architecture ``gemma3``): its norms stored as 1 + w
(the converter folds Gemma's offset in), ``post_attention_norm`` / ``ffn_norm`` /
``post_ffw_norm``, the sliding window in the metadata and the sliding layers fixed (every 6th
full, base 10000). A random checkpoint written that way reads back as the Hugging Face model:
logits within 1e-4 (float32), so a doubled or a missing + 1 fails; a Q8_0 file's logits follow
the float model's."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from seamline.weights.gguf import GGUFSource
from seamline.weights.gguf_file import GGUFFile
from seamline.weights.gguf_write import write_gguf_from_folder
from tests.support.family_checks import assert_gguf_follows, assert_gguf_matches
from tests.support.reference import save_random_model

ATOL = 1e-4
GEMMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=8,
    query_pre_attn_scalar=16,
    max_position_embeddings=256,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
)


def test_gemma3_gguf_reads_back_as_the_folder(tmp_path: Path) -> None:
    model = save_random_model(transformers.Gemma3TextConfig(**GEMMA), tmp_path / "hf")
    path = write_gguf_from_folder(tmp_path / "hf", tmp_path / "gemma3.gguf", "F32")
    f = GGUFFile.open(path)
    assert (
        f.get("general.architecture") == "gemma3" and f.get("gemma3.attention.sliding_window") == 8
    )
    theirs = model.model.layers[0].post_feedforward_layernorm.weight.detach()
    held = GGUFSource(path).get("model.layers.0.post_feedforward_layernorm.weight")
    assert torch.allclose(held, theirs + 1.0), (
        "the file stores the norm as 1 + w, as llama.cpp's converter"
    )
    config = GGUFSource(path).config_dict()
    assert config["model_type"] == "gemma3_text" and config["query_pre_attn_scalar"] == 16
    want = assert_gguf_matches(model, path)
    assert_gguf_follows(
        want, write_gguf_from_folder(tmp_path / "hf", tmp_path / "gemma3-q8.gguf", "Q8_0")
    )
