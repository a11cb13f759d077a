"""Small random checkpoints of the newer families, with the embedded model's tokenizer (so text
round-trips), for mesh tests: Gemma 3's text model, gpt-oss with MXFP4 experts and GLM-4.5's MoE."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from seamline.app import default_model_path
from seamline.weights.gguf import chat_template_from_gguf, tokenizer_from_gguf
from tests.support.mxfp4 import write_mxfp4_experts
from tests.support.reference import save_random_model

CONTEXT = 256
SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=CONTEXT,
    sliding_window=8,
)


def with_embedded_tokenizer(folder: Path) -> Path:
    tokenizer_from_gguf(default_model_path()).save(str(folder / "tokenizer.json"))
    template = chat_template_from_gguf(default_model_path())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder


def _vocab() -> int:
    return tokenizer_from_gguf(default_model_path()).get_vocab_size()


def build_gemma3_folder(folder: Path) -> Path:
    from transformers import Gemma3TextConfig

    save_random_model(
        Gemma3TextConfig(
            vocab_size=_vocab(), intermediate_size=96, query_pre_attn_scalar=24, **SHAPE
        ),
        folder,
    )
    return with_embedded_tokenizer(folder)


def build_oss_folder(folder: Path) -> Path:
    """gpt-oss with its experts as MXFP4 blocks, as published."""
    from transformers import GptOssConfig

    model: Any = save_random_model(
        GptOssConfig(
            vocab_size=_vocab(),
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            **SHAPE,
        ),
        folder,
    )
    write_mxfp4_experts(model, folder)
    return with_embedded_tokenizer(folder)


def build_glm4_moe_folder(folder: Path) -> Path:
    """GLM-4.5-style MoE (``tests/support/glm.py``'s shape, 4 layers, q/k norms), no sliding window."""
    import transformers

    from tests.support.deepseek import randomize
    from tests.support.glm import GLM

    shape = {
        **GLM,
        "vocab_size": _vocab(),
        "num_hidden_layers": 4,
        "max_position_embeddings": CONTEXT,
    }
    model = transformers.Glm4MoeForCausalLM(
        transformers.Glm4MoeConfig(**shape, use_qk_norm=True)
    ).eval()
    randomize(model, 0)
    model.save_pretrained(folder)
    return with_embedded_tokenizer(folder)
