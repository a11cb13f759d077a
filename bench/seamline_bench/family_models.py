"""The random checkpoints `bench families` runs: one layer shape of each newer family, written
once as a GGUF file in llama.cpp's Q4_K_M mix and cached.

Each family's layer is its released model's (``SHAPES``: gpt-oss-20b, Gemma-3-1B, GLM-4.5-Air)
over a few layers, with the embedded model's 49152-token vocabulary (so its tokenizer can ride
along) instead of the real 200k / 262k / 151k: the embedding and the head are not a layer's
shape. ``RandomFamily`` names the tensors as a Hugging Face folder of the family reads
(``HFFolderSource``: gpt-oss's experts one per expert) and makes each on demand, so the writer
streams them. ``tiny`` shrinks a shape to seconds' worth while keeping its structure (layers,
layer kinds, window, experts' routing).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from seamline_bench.quant import RandomTensors

VOCAB = 49152  # the embedded model's tokenizer
PRESET = "Q4_K_M"
CACHE_KEY = "v1"

GPT_OSS: dict[str, Any] = {
    "model_type": "gpt_oss",
    "vocab_size": VOCAB,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 2,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"],
    "attention_bias": True,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "swiglu_limit": 7.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    "bos_token_id": 1,
    "eos_token_id": 2,
}  # gpt-oss-20b's layer: attention sinks, biases, 32 experts top-4
GEMMA3: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": VOCAB,
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "max_position_embeddings": 32768,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}  # Gemma-3-1B's layer; 6 layers: GGUF fixes every 6th full, so 5 sliding and 1 full
GLM4_MOE: dict[str, Any] = {
    "model_type": "glm4_moe",
    "vocab_size": VOCAB,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "num_hidden_layers": 2,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "partial_rotary_factor": 0.5,
    "n_routed_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1408,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "use_qk_norm": False,
    "attention_bias": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}  # GLM-4.5-Air's layers: one dense, one of 128 routed experts top-8 and a shared one
SHAPES: dict[str, dict[str, Any]] = {"gpt_oss": GPT_OSS, "gemma3": GEMMA3, "glm4_moe": GLM4_MOE}
SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "first_k_dense_replace",
    "sliding_window",
    "layer_types",
    "sliding_window_pattern",
    "partial_rotary_factor",
    "query_pre_attn_scalar",
    "attention_bias",
)
TINY: dict[str, dict[str, Any]] = {
    "gpt_oss": {
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
    },
    "gemma3": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 2,
        "head_dim": 128,
        "query_pre_attn_scalar": 128,
        "sliding_window": 8,
    },
    "glm4_moe": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
    },
}  # rows of 256: the K types' blocks, as the real shapes have where they can


def tiny(family: str, vocab: int = VOCAB) -> dict[str, Any]:
    """``family``'s shape shrunk to seconds of work, its structure kept."""
    return {**SHAPES[family], **TINY[family], "vocab_size": vocab}


def shape_summary(config: dict[str, Any]) -> dict[str, Any]:
    """The layer-shape fields of ``config`` a report shows."""
    return {k: config[k] for k in SHAPE_KEYS if k in config}


class RandomFamily(RandomTensors):
    """HF-named random tensors of one family's ``config``: norms at one, matrices, biases and
    sinks N(0, 0.02), each seeded by its name."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.shapes = dict(family_shapes(config))

    def is_one(self, name: str) -> bool:
        return name.endswith("norm.weight")


def family_shapes(c: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor of the model ``c`` (a config.json dict) describes."""
    h, vocab = int(c["hidden_size"]), int(c["vocab_size"])
    yield "model.embed_tokens.weight", (vocab, h)
    yield "model.norm.weight", (h,)
    if not c.get("tie_word_embeddings"):
        yield "lm_head.weight", (vocab, h)
    for layer in range(int(c["num_hidden_layers"])):
        prefix = f"model.layers.{layer}."
        for name, shape in [*_attention(c), *_norms(c), *_feed_forward(c, layer)]:
            yield prefix + name, shape


def _attention(c: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, d = int(c["hidden_size"]), int(c["head_dim"])
    q, kv = int(c["num_attention_heads"]) * d, int(c["num_key_value_heads"]) * d
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    for proj, out in rows.items():
        yield f"self_attn.{proj}.weight", (out, h)
        if c.get("attention_bias"):
            yield f"self_attn.{proj}.bias", (out,)
    yield "self_attn.o_proj.weight", (h, q)
    if c["model_type"] == "gpt_oss":
        yield "self_attn.o_proj.bias", (h,)
        yield "self_attn.sinks", (int(c["num_attention_heads"]),)
    if c["model_type"] == "gemma3_text" or c.get("use_qk_norm"):
        yield "self_attn.q_norm.weight", (d,)
        yield "self_attn.k_norm.weight", (d,)


def _norms(c: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    h = int(c["hidden_size"])
    names = ["input_layernorm", "post_attention_layernorm"]
    if c["model_type"] == "gemma3_text":
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for name in names:
        yield f"{name}.weight", (h,)


def _mlp(
    prefix: str, h: int, rows: int, bias: bool = False
) -> Iterator[tuple[str, tuple[int, ...]]]:
    for proj, shape in (("gate_proj", (rows, h)), ("up_proj", (rows, h)), ("down_proj", (h, rows))):
        yield f"{prefix}.{proj}.weight", shape
        if bias:
            yield f"{prefix}.{proj}.bias", shape[:1]


def _feed_forward(c: dict[str, Any], layer: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, family = int(c["hidden_size"]), c["model_type"]
    if family == "gpt_oss":
        experts = int(c["num_local_experts"])
        yield "mlp.router.weight", (experts, h)
        yield "mlp.router.bias", (experts,)
        for e in range(experts):
            yield from _mlp(f"mlp.experts.{e}", h, int(c["intermediate_size"]), bias=True)
    elif family == "glm4_moe" and layer >= int(c.get("first_k_dense_replace") or 0):
        experts, rows = int(c["n_routed_experts"]), int(c["moe_intermediate_size"])
        yield "mlp.gate.weight", (experts, h)
        yield "mlp.gate.e_score_correction_bias", (experts,)
        for e in range(experts):
            yield from _mlp(f"mlp.experts.{e}", h, rows)
        yield from _mlp("mlp.shared_experts", h, rows * int(c.get("n_shared_experts") or 1))
    else:
        yield from _mlp("mlp", h, int(c["intermediate_size"]))


def write_family(path: Path, config: dict[str, Any], tokenizer: Path | None = None) -> Path:
    """``config``'s random model as a GGUF file in ``PRESET`` at ``path`` (written beside it as
    .partial, then renamed); ``tokenizer``: a GGUF whose tokenizer the file carries."""
    from seamline.weights.gguf_write import write_gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    write_gguf(
        partial,
        config,
        RandomFamily(config),
        PRESET,
        tokenizer_from=tokenizer,
        name=f"random-{config['model_type']}",
    )
    partial.rename(path)
    return path


def family_path(family: str, root: Path | None = None, tokenizer: Path | None = None) -> Path:
    """The cached file of ``family``'s shape (written on first use: up to a few minutes)."""
    from seamline_bench.gpu_models import cache_root, tokenizer_gguf

    path = (root or cache_root()) / f"family_{family}_{PRESET.lower()}_{CACHE_KEY}.gguf"
    if not path.is_file():
        write_family(path, SHAPES[family], tokenizer or tokenizer_gguf())
    return path


def file_types(path: Path) -> dict[str, Any]:
    """The file's tensor types: ``counts`` per GGUF type, and ``not_q4_k``: each weight matrix
    (by its name without ``blk.N.``) stored in another type, with those types. The mix gives
    Q6_K to the head and to attn_v / ffn_down in some layers; a row that is not whole 256-value
    blocks (a width of 2880, 1152, 1408, 10944) falls back to Q5_0, as llama.cpp's does."""
    from seamline.weights.gguf_file import GGUFFile

    counts: dict[str, int] = {}
    other: dict[str, set[str]] = {}
    for info in GGUFFile.open(path).tensors.values():
        kind = info.type_name
        counts[kind] = counts.get(kind, 0) + 1
        key = info.name.split(".", 2)[2] if info.name.startswith("blk.") else info.name
        if len(info.shape) >= 2 and kind not in ("Q4_K", "F32") and "gate_inp" not in key:
            other.setdefault(key, set()).add(kind)
    return {
        "counts": dict(sorted(counts.items())),
        "not_q4_k": {k: sorted(v) for k, v in sorted(other.items())},
    }
