"""A random DeepSeek-V3-style MoE checkpoint for benchmarks, built offline with transformers.

``bench``: 3 MoE layers, 64 routed experts (top-8 within the best 4 of 8 groups) and one
shared expert each, hidden 1024, expert width 768, vocabulary 32000: the routed experts are
1.81 GB of its 2.14 GB of float32 safetensors, and ~55% of the weights one token reads (as in
DeepSeek-V3, where the chosen experts are most of a token's reads; the output head is the
next largest share here, as the model is shallow).
``tiny``: the same architecture, small enough for a test.

Built once per config (fixed seed) under ``$SEAMLINE_CACHE/bench/<name>-<config hash>``
(default ``~/.cache/seamline``); a finished folder holds a ``.complete`` marker, so an
interrupted build is redone, not reused. transformers is needed only to build.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BUILDER_VERSION = 1
SEED = 0
MIN_BENCH_BYTES = 10**9  # the bench model's float32 safetensors must be at least this large

SIZES: dict[str, dict[str, Any]] = {
    "bench": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=768,
        num_hidden_layers=3,
        first_k_dense_replace=0,
        n_routed_experts=64,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
}


def cache_root() -> Path:
    return Path(os.environ.get("SEAMLINE_CACHE", "~/.cache/seamline")).expanduser() / "bench"


def model_dir(size: str) -> Path:
    """Where the checkpoint of ``size`` lives: the name carries a hash of what builds it."""
    recipe = json.dumps(
        {"config": SIZES[size], "seed": SEED, "builder": BUILDER_VERSION}, sort_keys=True
    )
    return (
        cache_root() / f"deepseek-v3-moe-{size}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    )


def safetensors_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def cached_build(folder: Path, write: Callable[[Path], None]) -> Path:
    """``folder``, written by ``write`` into a private folder first if it is not complete yet:
    an interrupted build leaves no ``.complete`` marker and is redone, never reused."""
    if (folder / ".complete").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        write(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    (partial / ".complete").write_text(
        json.dumps({"safetensors_bytes": safetensors_bytes(partial)}) + "\n"
    )
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def build_model(size: str = "bench") -> Path:
    """The cached checkpoint folder of ``size``; built (a minute or so for ``bench``) if absent."""
    if size not in SIZES:
        raise ValueError(f"model size must be one of {sorted(SIZES)}, not {size!r}")

    def write(partial: Path) -> None:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        torch.manual_seed(SEED)
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**SIZES[size])).eval()
        model.save_pretrained(partial, safe_serialization=True)
        total = safetensors_bytes(partial)
        if size == "bench" and total < MIN_BENCH_BYTES:
            raise RuntimeError(
                f"the bench checkpoint has {total} bytes of safetensors, under {MIN_BENCH_BYTES}"
            )

    return cached_build(model_dir(size), write)


def model_facts(folder: Path) -> dict[str, Any]:
    """What the JSON reports about the checkpoint."""
    config = json.loads((folder / "config.json").read_text())
    experts, inter, hidden = (
        config["n_routed_experts"],
        config["moe_intermediate_size"],
        config["hidden_size"],
    )
    moe_layers = config["num_hidden_layers"] - config["first_k_dense_replace"]
    return {
        "name": folder.name,
        "architecture": "DeepseekV3ForCausalLM (random weights, seed 0)",
        "checkpoint_bytes": safetensors_bytes(folder),
        "routed_expert_bytes": moe_layers * experts * 3 * hidden * inter * 4,
        "layers": config["num_hidden_layers"],
        "moe_layers": moe_layers,
        "routed_experts": experts,
        "experts_per_token": config["num_experts_per_tok"],
        "hidden": hidden,
        "moe_intermediate": inter,
        "vocab": config["vocab_size"],
    }
