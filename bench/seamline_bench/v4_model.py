"""A random DeepSeek-V4-shaped checkpoint for benchmarks, written directly (no transformers).

``bench``: hidden 4096, hc_mult 4, 2 layers (compressed sparse attention with top-k routed
experts, then heavily compressed attention with hash-routed ones), 64 heads of 512 with one
shared key/value head, 16 routed experts of 2048 rows (top 6) and a shared one, bfloat16, the
embedded model's tokenizer (vocabulary 49152): V4-Flash's layer shapes, two of its layers.
``tiny``: the same layout, small enough for a test.

The tensors are named and shaped as transformers writes a V4 checkpoint (``weights/v4_names``),
drawn at random with a fixed seed (matrices at 1/sqrt(fan-in), norms at one), under
``$SEAMLINE_CACHE/bench/<name>-<recipe hash>``; a finished folder holds ``.complete``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from seamline_bench.moe_model import cache_root, cached_build

BUILDER_VERSION = 1
SEED = 0
ROPE = {"rope_type": "default", "partial_rotary_factor": 0.125}
SIZES: dict[str, dict[str, Any]] = {
    "bench": dict(
        hidden_size=4096,
        num_attention_heads=64,
        head_dim=512,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        moe_intermediate_size=2048,
        n_routed_experts=16,
        num_experts_per_tok=6,
        sliding_window=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    ),
    "tiny": dict(
        hidden_size=64,
        num_attention_heads=8,
        head_dim=32,
        q_lora_rank=32,
        o_groups=4,
        o_lora_rank=16,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=4,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    ),
}


def v4_config_dict(size: str, vocab: int) -> dict[str, Any]:
    """config.json of the bench model, as transformers writes a DeepseekV4Config."""
    return dict(
        architectures=["DeepseekV4ForCausalLM"],
        model_type="deepseek_v4",
        vocab_size=vocab,
        num_hidden_layers=2,
        num_key_value_heads=1,
        n_shared_experts=1,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        partial_rotary_factor=0.125,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_parameters={
            "main": {**ROPE, "rope_theta": 10000.0},
            "compress": {**ROPE, "rope_theta": 160000.0},
        },
        routed_scaling_factor=1.5,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=True,
        swiglu_limit=10.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype="bfloat16",
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["moe", "hash_moe"],
        bos_token_id=None,
        eos_token_id=None,
        **SIZES[size],
    )


def model_dir(size: str) -> Path:
    recipe = json.dumps(
        {"config": SIZES[size], "seed": SEED, "builder": BUILDER_VERSION}, sort_keys=True
    )
    return cache_root() / f"deepseek-v4-{size}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def build_v4_model(size: str = "bench") -> Path:
    """The cached checkpoint folder of ``size``; written (a minute or so for ``bench``) if absent."""
    if size not in SIZES:
        raise ValueError(f"model size must be one of {sorted(SIZES)}, not {size!r}")

    def write(partial: Path) -> None:
        config = v4_config_dict(size, _copy_tokenizer(partial))
        (partial / "config.json").write_text(json.dumps(config, indent=2))
        _write_tensors(partial, config)

    return cached_build(model_dir(size), write)


def _copy_tokenizer(folder: Path) -> int:
    """The embedded model's tokenizer and chat template (the API speaks text); its vocabulary size."""
    from seamline.app import default_model_path
    from seamline.weights.gguf import chat_template_from_gguf, tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(default_model_path())
    tokenizer.save(str(folder / "tokenizer.json"))
    template = chat_template_from_gguf(default_model_path())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return int(tokenizer.get_vocab_size())


def _write_tensors(folder: Path, config_dict: dict[str, Any]) -> None:
    """One safetensors file per layer (and one for the embedding and head), with an index."""
    from seamline.config import ModelConfig
    from seamline.model.v4_stage import V4Stage
    from seamline.ownership import Ownership
    from seamline.weights.v4_names import v4_plans

    config = ModelConfig.from_hf_dict(config_dict)
    shapes = {
        n: tuple(p.shape) for n, p in V4Stage(config, Ownership.full(config)).named_parameters()
    }
    generator = torch.Generator().manual_seed(SEED)
    files: dict[str, dict[str, torch.Tensor]] = {}
    for plan in v4_plans(config, Ownership.full(config)):
        target = shapes[plan.target][1:] if plan.stack else shapes[plan.target]
        for part in plan.parts:
            shape = (target[0] // len(part), *target[1:])
            for name in part:
                file = f"layer{name.split('.')[2]}" if name.startswith("model.layers.") else "ends"
                files.setdefault(file, {})[name] = _random(plan.target, shape, config, generator)
    weight_map = {}
    for file, tensors in files.items():
        save_file(tensors, str(folder / f"{file}.safetensors"), metadata={"format": "pt"})
        weight_map.update({name: f"{file}.safetensors" for name in tensors})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def _random(
    target: str, shape: tuple[int, ...], config: Any, generator: torch.Generator
) -> torch.Tensor:
    if target.endswith(".table"):
        return torch.randint(0, config.num_experts, shape, generator=generator)
    if target.endswith(("norm", "norm.weight", ".scale")):
        return torch.ones(shape, dtype=torch.bfloat16)
    if len(shape) == 1 or target.endswith("position_bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator) * shape[-1] ** -0.5).to(torch.bfloat16)
