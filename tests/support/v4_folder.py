"""A small DeepSeek-V4 checkpoint folder for mesh tests."""

from __future__ import annotations

from pathlib import Path

from tests.support.v4_reference import random_v4, v4_config, with_tokenizer

CONTEXT = 256


PROMPT = "The rivers of Europe include"


def build_v4_folder(folder: Path, attention_scale: float = 1.0, echo_mtp: bool = False) -> Path:
    """A random 4-layer V4 (a hash-routed layer in each half) with the embedded tokenizer.
    ``attention_scale`` scales the attention's output projections: small, each token's next
    depends mostly on the token itself, so greedy answers fall into loops that n-grams draft.
    ``echo_mtp``: layers that add nothing, and a multi-token-prediction layer whose greedy
    drafts are right (``tests/support/v4_mtp.py``)."""
    import torch

    from seamline.app import default_model_path
    from seamline.weights.gguf import tokenizer_from_gguf
    from tests.support.v4_mtp import add_v4_mtp, silence_v4

    vocab = tokenizer_from_gguf(default_model_path()).get_vocab_size()
    config = v4_config(
        vocab=vocab,
        layers=4,
        mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"],
        max_position_embeddings=CONTEXT,
    )
    model = random_v4(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("o_b_proj.weight"):
                p.mul_(attention_scale)
    if echo_mtp:
        silence_v4(model)
    model.save_pretrained(folder)
    if echo_mtp:
        add_v4_mtp(model, folder, echo=True)
    return with_tokenizer(folder)
