"""A small MoE checkpoint folder for mesh tests."""

from __future__ import annotations

import json
from pathlib import Path

from seamline.app import default_model_path
from seamline.weights.gguf import chat_template_from_gguf, tokenizer_from_gguf
from tests.support.reference import save_random_model

CONTEXT = 512


PROMPT = "The rivers of Europe include"


def build_moe_folder(folder: Path, attention_scale: float = 1.0, hidden_size: int = 64) -> Path:
    """A tiny random Mixtral with the embedded model's tokenizer (so text round-trips).
    ``attention_scale`` scales the attention's output projections: small, each token's next
    depends mostly on the token itself, so greedy answers fall into loops that n-grams draft
    (short ones where ``hidden_size`` is narrow: few tokens ever win the head's argmax)."""
    import torch
    from transformers import MixtralConfig

    tokenizer = tokenizer_from_gguf(default_model_path())
    config = MixtralConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
    )
    model = save_random_model(config, folder)
    if attention_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("o_proj.weight"):
                    p.mul_(attention_scale)
        model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    template = chat_template_from_gguf(default_model_path())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder
