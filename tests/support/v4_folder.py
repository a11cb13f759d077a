"""A small DeepSeek-V4 checkpoint folder for mesh tests."""

from __future__ import annotations

from pathlib import Path

from tests.support.v4_reference import save_random_v4, v4_config, with_tokenizer

CONTEXT = 256


PROMPT = "The rivers of Europe include"


def build_v4_folder(folder: Path) -> Path:
    """A random 4-layer V4 (a hash-routed layer in each half) with the embedded tokenizer."""
    from seamline.app import default_model_path
    from seamline.weights.gguf import tokenizer_from_gguf

    vocab = tokenizer_from_gguf(default_model_path()).get_vocab_size()
    config = v4_config(vocab=vocab, layers=4, mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"],
                       max_position_embeddings=CONTEXT)  # fmt: skip
    save_random_v4(folder, config)
    return with_tokenizer(folder)
