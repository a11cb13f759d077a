"""`seamline bench quant`: seamline on quantized weights, its dequantised path, and llama.cpp.

Two GGUF files: the embedded SmolLM2 (Q4_1, Q8_0 tied head) and a Llama-shaped model of
about 1.1B parameters with random weights, written once in llama.cpp's Q4_K_M mix and cached.
Each party runs in its own process (``quant_driver``) on the same file, prompt and threads:
seamline's default (what a user gets with no flag: bfloat16 activations in int8 blocks in the
matmuls, as llama.cpp), its exact path (``--precision exact``: float32 activations on the
blocks), seamline's default on dequantised bfloat16 weights, and
llama.cpp's `llama-bench` built at its best here (``llama_server``: AVX-512 without AMX,
repacking on; the JSON's ``llama_cpp`` names the build and its cmake flags). The parties take
turns, one measurement at a time, for ``repeats`` rounds; medians are reported. ``ratio`` is
the default's decode rate over llama.cpp's (``targets``: at least 0.8 on the embedded model,
1.0 on the 1.1B). Resident memory comes from ``resident`` (a fresh process loading the whole
model).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from seamline.app import default_model_path
from seamline_bench.driver import Driver, median
from seamline_bench.llama_server import LlamaBuild
from seamline_bench.resident import measure_in_subprocess

PARTIES = ("default", "exact", "dequant", "llamacpp")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
ACTIVATIONS = "bfloat16"  # the default path's activations: what a user of a quantized model runs
LLAMACPP_HINT = "Building llama.cpp needs cmake, a C++ compiler and PyPI (for llama-cpp-python's source package)."
TARGETS = {
    "embedded.ratio": 0.8,
    "llama_1b.ratio": 1.0,
}  # seamline's default over llama.cpp, decode
LLAMA_1B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}  # TinyLlama's shape, with the embedded model's tokenizer
CACHE_KEY = "llama_1b_q4km_v1"


class RandomTensors:
    """HF-named random tensors of ``shapes``, made on demand (the writer streams them): ones
    where ``is_one`` says (norms), else N(0, 0.02) seeded by the name."""

    shapes: dict[str, tuple[int, ...]]

    def names(self) -> set[str]:
        return set(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def is_one(self, name: str) -> bool:
        return len(self.shapes[name]) == 1

    def get(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        if self.is_one(name):
            return np.ones(shape, np.float32)
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        return rng.standard_normal(shape, np.float32) * np.float32(0.02)


class RandomLlama(RandomTensors):
    """HF-named random tensors of ``LLAMA_1B``."""

    def __init__(self, config: dict[str, Any]) -> None:
        h, i, kv = (
            config["hidden_size"],
            config["intermediate_size"],
            config["num_key_value_heads"] * config["head_dim"],
        )
        self.shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (config["vocab_size"], h),
            "lm_head.weight": (config["vocab_size"], h),
            "model.norm.weight": (h,),
        }
        per_layer = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (h, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, h),
            "mlp.gate_proj.weight": (i, h),
            "mlp.up_proj.weight": (i, h),
            "mlp.down_proj.weight": (h, i),
        }
        for layer in range(config["num_hidden_layers"]):
            self.shapes.update({f"model.layers.{layer}.{k}": v for k, v in per_layer.items()})


def llama_1b_path(cache_root: Path | None = None, tokenizer: Path | None = None) -> Path:
    """The cached 1B Q4_K_M file, written on first use (about a minute), with ``tokenizer``'s
    vocabulary (default: the embedded model's)."""
    from seamline.weights.gguf_write import write_gguf

    root = (
        cache_root
        or Path(os.environ.get("SEAMLINE_CACHE", Path.home() / ".cache" / "seamline")) / "bench"
    )
    path = root / f"{CACHE_KEY}.gguf"
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_gguf(
            partial,
            LLAMA_1B,
            RandomLlama(LLAMA_1B),
            "Q4_K_M",
            tokenizer_from=tokenizer or default_model_path(),
            name="random-llama-1b",
        )
        partial.rename(path)
    return path


def bench_quant(repeats: int = 3, tokens: int = 64, threads: int | None = None) -> dict[str, Any]:
    from seamline.text import TextCodec
    from seamline_bench.llama_server import llama_cpp_build

    threads = threads or torch.get_num_threads()
    codec = TextCodec.from_model(default_model_path(), ())
    prompt = codec.encode_chat([{"role": "user", "content": PROMPT}])
    build, why = llama_cpp_build()
    models = {"embedded": default_model_path(), "llama_1b": llama_1b_path()}
    out = {
        name: _bench_model(path, prompt, repeats, tokens, threads, build, why)
        for name, path in models.items()
    }
    ratios = {f"{name}.ratio": out[name]["ratio"] for name in models}
    return {
        "bench": "quant",
        "threads": threads,
        "tokens": tokens,
        "repeats": repeats,
        "models": out,
        "llama_cpp": build.describe() if build else {"unavailable": why},
        "targets": TARGETS,
        "targets_met": targets_met(ratios, TARGETS),
    }


def targets_met(figures: dict[str, Any], targets: dict[str, float]) -> dict[str, bool | None]:
    """Each target's figure at least its threshold (None: not measured)."""
    return {
        k: None if figures.get(k) is None else bool(figures[k] >= t) for k, t in targets.items()
    }


def _bench_model(
    path: Path,
    prompt: list[int],
    repeats: int,
    tokens: int,
    threads: int,
    build: LlamaBuild | None,
    why: str = "",
) -> dict[str, Any]:
    """Every party on ``path``, alternating, ``repeats`` rounds; llama.cpp is ``build``'s
    `llama-bench` (None: reported null, with ``why``)."""
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PARTIES}
    bench_binary = str(build.bench) if build else ""
    drivers = {
        p: Driver(
            "seamline_bench.quant_driver",
            [p, str(path), str(threads), json.dumps(prompt), bench_binary],
        )
        for p in PARTIES
    }
    try:
        ready = {p: d.wait_ready() for p, d in drivers.items()}
        live = [p for p in PARTIES if "unavailable" not in ready[p]]
        for _ in range(repeats):
            for party in live:  # alternating: each round measures every party once
                runs[party].append(drivers[party].measure(tokens))
    finally:
        for d in drivers.values():
            d.close()
    resident = measure_in_subprocess(path, 0, _layers(path), ACTIVATIONS)
    summary = _summary(runs, resident)
    if build is None:
        summary["llamacpp_note"] = (
            f"llama.cpp was not measured: {why or 'no build'}. {LLAMACPP_HINT}"
        )
    return summary


def _layers(path: Path) -> int:
    from seamline.config import ModelConfig
    from seamline.weights.loader import open_source

    return ModelConfig.from_hf_dict(open_source(path).config_dict()).num_layers


def _summary(runs: dict[str, list[dict[str, Any]]], resident: dict[str, Any]) -> dict[str, Any]:
    def rate(party: str, key: str) -> float | None:
        return round(median(runs[party], key), 2) if runs[party] else None

    ours, theirs = rate("default", "decode_tok_s"), rate("llamacpp", "decode_tok_s")
    exact = rate("exact", "decode_tok_s")
    return {
        "seamline_tok_s": ours,
        "dequant_tok_s": rate("dequant", "decode_tok_s"),
        "llamacpp_tok_s": theirs,
        "ratio": round(ours / theirs, 3) if ours and theirs else None,
        "prefill_tok_s": {
            "seamline": rate("default", "prefill_tok_s"),
            "dequant": rate("dequant", "prefill_tok_s"),
            "llamacpp": rate("llamacpp", "prefill_tok_s"),
            "seamline_exact": rate("exact", "prefill_tok_s"),
        },
        "activation_dtype": ACTIVATIONS,
        "matmul_activations": "int8 blocks, as llama.cpp (seamline's default: no flag, --precision fast)",
        "exact_path": "--precision exact: float32 activations, the blocks decoded as gguf-py decodes them",
        "seamline_exact_tok_s": exact,
        "exact_ratio": round(exact / theirs, 3) if exact and theirs else None,
        "resident_weight_bytes": resident["resident_weight_bytes"],
        "gguf_tensor_bytes": resident["gguf_tensor_bytes"],
        "memory_ratio": round(resident["resident_weight_bytes"] / resident["gguf_tensor_bytes"], 3),
        "runs": runs,
    }
