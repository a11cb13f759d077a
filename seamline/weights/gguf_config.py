"""GGUF metadata -> a Hugging Face config.json dict (parsed by ``ModelConfig.from_hf_dict``).

llama.cpp keys its hyperparameters by architecture (``llama.block_count``); it calls a Mixtral
``llama`` with ``llama.expert_count > 0``. Llama-3 RoPE scaling is not in the metadata at all:
the converter bakes it into a ``rope_freqs.weight`` tensor of per-frequency divisors, from which
``llama3_rope_scaling`` recovers the config.json parameters (and checks that they reproduce it).
DeepSeek-V2/V3 are ``deepseek2`` (V3: a sigmoid-gated router, ``exp_probs_b`` bias tensors);
their latent-attention sizes, routing and yarn ``mscale`` are rebuilt in ``_mla``. A sliding
window (``{arch}.attention.sliding_window``) becomes the config.json fields that activate it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from seamline.errors import CheckpointError
from seamline.weights.gguf_file import GGUFFile

# general.architecture -> model_type
FAMILY_OF_ARCH: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "deepseek2": "deepseek_v2",  # deepseek_v3 when its router is sigmoid-gated (family_of)
    "gemma3": "gemma3_text",
    "glm4moe": "glm4_moe",
    "gpt-oss": "gpt_oss",
}
GEMMA3_27B_LAYERS = (
    62  # llama.cpp scales Gemma 3 27B's queries by hidden / heads, others' by head_dim
)

# {arch}.expert_gating_func values (gguf's ExpertGatingFuncType)
GATING_FUNCS: dict[int, str] = {1: "softmax", 2: "sigmoid"}

# model_type -> config.json fields that make its sliding window active (see ModelConfig);
# a family without an entry has no sliding-window attention in transformers.
SLIDING_FIELDS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "mistral"},  # a llama-arch file with a window is Mistral-style
    "mixtral": {},
    "qwen2": {"use_sliding_window": True, "max_window_layers": 0},
    "qwen3": {"use_sliding_window": True, "max_window_layers": 0},
    "qwen3_moe": {"use_sliding_window": True},
    "gemma3_text": {},  # every 6th layer full, as llama.cpp and transformers have it
    "gpt_oss": {},  # every 2nd layer full
}

# Architectures whose Q and K rows llama.cpp's converter permutes (LlamaModel.permute).
PERMUTED_ARCHS: frozenset[str] = frozenset({"llama"})

# The converter's default when config.json gives no top-level original_max_position_embeddings.
LLAMA3_ORIGINAL_CONTEXT = 8192

_MISSING = object()


def family_of(f: GGUFFile) -> str:
    arch = f.get("general.architecture")
    if arch not in FAMILY_OF_ARCH:
        raise CheckpointError(
            f"GGUF file {f.path} has architecture {arch!r}; seamline reads "
            f"{', '.join(sorted(FAMILY_OF_ARCH))}"
        )
    if arch == "llama" and int(f.get("llama.expert_count", 0) or 0) > 0:
        return "mixtral"
    if arch == "deepseek2":
        gating = GATING_FUNCS.get(int(f.get("deepseek2.expert_gating_func", 0) or 0))
        biased = any(name.endswith(".exp_probs_b.bias") for name in f.tensors)
        return "deepseek_v3" if gating == "sigmoid" or biased else "deepseek_v2"
    return FAMILY_OF_ARCH[arch]


def _f32(x: float) -> float:
    """A float32 metadata value at its shortest spelling (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _uniform(f: GGUFFile, key: str, value: Any) -> int:
    """A per-layer list must be constant: seamline's families do not vary heads by layer."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise CheckpointError(f"GGUF file {f.path}: '{key}' varies by layer ({value[:4]}...)")
        return int(value[0])
    return int(value)


def config_dict(f: GGUFFile, family: str, rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """The config.json dict for ``f``; ``rope_freqs`` is the dequantised rope_freqs tensor."""
    arch = str(f.get("general.architecture"))

    def meta(key: str, default: Any = _MISSING) -> Any:
        value = f.get(f"{arch}.{key}", default)
        if value is _MISSING:
            raise CheckpointError(f"GGUF file {f.path} has no '{arch}.{key}' metadata")
        return value

    heads = _uniform(f, "attention.head_count", meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    q = f.tensors.get("blk.0.attn_q.weight")  # [heads * head_dim, hidden]
    head_dim = int(
        meta("attention.key_length", 0) or (q.shape[0] if q is not None else hidden) // heads
    )
    embed = f.tensors.get("token_embd.weight")
    if embed is None:
        raise CheckpointError(f"GGUF file {f.path} has no token_embd.weight")
    d: dict[str, Any] = {
        "model_type": family,
        "vocab_size": embed.shape[0],  # the rows the weights have (== token count in practice)
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length", 0) or 0),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": _uniform(
            f, "attention.head_count_kv", meta("attention.head_count_kv", heads)
        ),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos(f),
    }
    scaling = _rope_scaling(f, meta, rope_freqs, d)
    if scaling is not None:
        d["rope_scaling"] = scaling
    d.update(_moe(f, family, meta, d["num_hidden_layers"]))
    if family in ("deepseek_v2", "deepseek_v3"):
        d.update(_mla(f, family, meta, d))
    d.update(_sliding_window(f, family, meta))
    if family == "glm4_moe":
        d.update(_glm(f, meta, d))
    if family == "gpt_oss":
        d.update(_oss(meta, d))
    if family == "gemma3_text":
        layers, hidden = d["num_hidden_layers"], d["hidden_size"]
        d["query_pre_attn_scalar"] = hidden // heads if layers == GEMMA3_27B_LAYERS else head_dim
    return d


def eos_ids(f: GGUFFile) -> list[int]:
    """EOS, then the end-of-turn / end-of-message ids when the file names different ones."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = f.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _eos(f: GGUFFile) -> int | list[int] | None:
    ids = eos_ids(f)
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _moe(f: GGUFFile, family: str, meta: Callable[..., Any], layers: int) -> dict[str, Any]:
    if family not in ("mixtral", "qwen3_moe"):
        return {}
    experts, used = int(meta("expert_count")), int(meta("expert_used_count"))
    expert_ffn = int(meta("expert_feed_forward_length", 0) or 0)
    if family == "mixtral":
        d: dict[str, Any] = {"num_local_experts": experts, "num_experts_per_tok": used}
        if expert_ffn:
            d["intermediate_size"] = expert_ffn
        return d
    # llama.cpp's qwen3moe always renormalises the top-k weights; a layer without a router is dense.
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors]
    return {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": expert_ffn or _expert_rows(f, layers, dense),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }


def _mla(f: GGUFFile, family: str, meta: Callable[..., Any], d: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3. Newer files describe attention as llama.cpp runs it (one latent KV head
    of kv_lora + rope dims) and keep the per-head sizes in the ``*_mla`` keys; older files have
    only key_length = nope + rope and value_length = v."""
    rope = int(meta("rope.dimension_count"))
    key = int(meta("attention.key_length_mla", 0) or meta("attention.key_length"))
    value = int(meta("attention.value_length_mla", 0) or meta("attention.value_length"))
    gating = int(meta("expert_gating_func", 0) or 0)
    if gating and gating not in GATING_FUNCS:
        raise CheckpointError(
            f"GGUF file {f.path}: expert_gating_func {gating} is neither softmax nor sigmoid"
        )
    v3 = family == "deepseek_v3"
    groups = int(meta("expert_group_count", 1) or 1)
    used_groups = int(meta("expert_group_used_count", 1) or 1)
    limited = groups > 1 and used_groups < groups
    out: dict[str, Any] = {
        "num_key_value_heads": d["num_attention_heads"],  # MLA expands the latent per head
        "head_dim": key,
        "q_lora_rank": int(meta("attention.q_lora_rank", 0) or 0) or None,
        "kv_lora_rank": int(meta("attention.kv_lora_rank")),
        "qk_nope_head_dim": key - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": value,
        "first_k_dense_replace": int(meta("leading_dense_block_count", 0) or 0),
        "moe_layer_freq": 1,
        "n_routed_experts": int(meta("expert_count", 0) or 0),
        "num_experts_per_tok": int(meta("expert_used_count", 0) or 0),
        "moe_intermediate_size": int(meta("expert_feed_forward_length", 0) or 0),
        "n_shared_experts": int(meta("expert_shared_count", 0) or 0),
        "norm_topk_prob": bool(meta("expert_weights_norm", False)),
        "routed_scaling_factor": _f32(meta("expert_weights_scale", 1.0) or 1.0),
        "n_group": groups,
        "topk_group": used_groups,
        "scoring_func": GATING_FUNCS.get(gating, "sigmoid" if v3 else "softmax"),
        "topk_method": "noaux_tc" if v3 else "group_limited_greedy" if limited else "greedy",
        "rope_interleave": True,  # llama.cpp rotates DeepSeek's adjacent pairs (as the weights are)
    }
    scaling = d.get("rope_scaling")
    if scaling is not None and scaling["rope_type"] == "yarn":
        scaling.update(_deepseek_yarn(f, meta))
    return out


def _glm(f: GGUFFile, meta: Callable[..., Any], d: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5: DeepSeek-V3's routing over GQA attention turning ``rope.dimension_count`` dims of
    each head; its block count includes the multi-token-prediction layers (``nextn``), which
    seamline does not run."""
    nextn = int(meta("nextn_predict_layers", 0) or 0)
    return {
        "num_hidden_layers": d["num_hidden_layers"] - nextn,
        "num_nextn_predict_layers": nextn,
        "partial_rotary_factor": int(meta("rope.dimension_count", d["head_dim"])) / d["head_dim"],
        "use_qk_norm": "blk.0.attn_q_norm.weight" in f.tensors,
        "first_k_dense_replace": int(meta("leading_dense_block_count", 0) or 0),
        "n_routed_experts": int(meta("expert_count")),
        "num_experts_per_tok": int(meta("expert_used_count")),
        "n_shared_experts": int(meta("expert_shared_count", 0) or 0),
        "moe_intermediate_size": int(meta("expert_feed_forward_length")),
        "routed_scaling_factor": _f32(meta("expert_weights_scale", 1.0) or 1.0),
        "norm_topk_prob": bool(meta("expert_weights_norm", False)),
        "n_group": int(meta("expert_group_count", 1) or 1),
        "topk_group": int(meta("expert_group_used_count", 1) or 1),
    }


def _oss(meta: Callable[..., Any], d: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: its experts. The file cannot say whether YaRN's ramp is truncated: llama.cpp
    always truncates it (whole correction dims), so a GGUF answers as llama.cpp answers it,
    where the Hugging Face config (``"truncate": false``) does not."""
    out: dict[str, Any] = {
        "num_local_experts": int(meta("expert_count")),
        "num_experts_per_tok": int(meta("expert_used_count")),
        "intermediate_size": int(meta("expert_feed_forward_length")),
    }
    if (scaling := d.get("rope_scaling")) is not None and scaling["rope_type"] == "yarn":
        scaling["truncate"] = True
    return out


def _deepseek_yarn(f: GGUFFile, meta: Callable[..., Any]) -> dict[str, Any]:
    """llama.cpp's deepseek2 keeps the rotary magnitude at 1 and scales the attention logits by
    (1 + log_mul * ln factor)^2 with log_mul = 0.1 * mscale_all_dim: in config.json terms,
    mscale = mscale_all_dim (or, with no multiplier, an attention_factor of 1)."""
    attn_factor = meta("rope.scaling.yarn_attn_factor", None)
    if attn_factor is not None and abs(float(attn_factor) - 1.0) > 1e-6:
        raise CheckpointError(
            f"GGUF file {f.path}: rope.scaling.yarn_attn_factor {attn_factor} is not supported"
        )
    log_mul = float(meta("rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
    if not log_mul:
        return {"attention_factor": 1.0}
    mscale = float(f"{log_mul / 0.1:.6g}")
    return {"mscale": mscale, "mscale_all_dim": mscale}


def _sliding_window(f: GGUFFile, family: str, meta: Callable[..., Any]) -> dict[str, Any]:
    """``{arch}.attention.sliding_window`` as the config.json fields that make it active, so that
    ``ModelConfig`` applies it to the layers transformers would (``SLIDING_RULES``)."""
    window = int(meta("attention.sliding_window", 0) or 0)
    if not window:
        return {}
    if family not in SLIDING_FIELDS:
        raise CheckpointError(
            f"GGUF file {f.path} has attention.sliding_window {window}, which {family} "
            f"does not have in seamline"
        )
    return {"sliding_window": window, **SLIDING_FIELDS[family]}


def _expert_rows(f: GGUFFile, layers: int, dense: list[int]) -> int:
    """An expert's intermediate size: the first MoE layer's stacked gate is [E, inter, hidden]."""
    first = next((i for i in range(layers) if i not in dense), None)
    name = f"blk.{first}.ffn_gate_exps.weight"
    if name not in f.tensors:
        raise CheckpointError(f"GGUF file {f.path} has a router but no {name}")
    return f.tensors[name].shape[1]


def _rope_scaling(
    f: GGUFFile, meta: Callable[..., Any], rope_freqs: np.ndarray | None, d: dict[str, Any]
) -> dict[str, Any] | None:
    kind = meta("rope.scaling.type", None)
    factor = meta("rope.scaling.factor", None) or meta("rope.scale_linear", None)
    if rope_freqs is not None:
        if kind not in (None, "none"):
            raise CheckpointError(
                f"GGUF file {f.path} has both rope_freqs.weight and rope scaling '{kind}'"
            )
        return llama3_rope_scaling(rope_freqs, d["rope_theta"], d["head_dim"], str(f.path))
    if kind in (None, "none") and not factor:
        return None
    if kind in (None, "linear"):
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        out: dict[str, Any] = {"rope_type": "yarn", "factor": _f32(factor or 1.0)}
        for key, hf_key in (
            ("rope.scaling.original_context_length", "original_max_position_embeddings"),
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ):
            if meta(key, None) is not None:
                out[hf_key] = meta(key)
        return out
    raise CheckpointError(
        f"GGUF file {f.path} has rope scaling type {kind!r}; seamline reads linear, yarn"
    )


def llama3_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """llama.cpp's converter: one divisor per rotary frequency (1 = unscaled)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (context / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, mid))


def _bounds_around(
    x: np.ndarray, r: np.ndarray, factor: float, scaled: np.ndarray, interior: np.ndarray
) -> tuple[float, float]:
    """low < x_i < high with x_i's divisor, above the fully scaled x and below the unscaled:
    one equation in two unknowns, and any solution gives the file's divisors. ``high`` is
    brought toward x_i until ``low`` (which follows it there) clears the scaled frequencies."""
    xi = float(x[interior][0])
    s = (1 / float(r[interior][0]) - 1 / factor) / (1 - 1 / factor)  # (xi - low) / (high - low)
    below = float(x[scaled & ~interior].max()) if (scaled & ~interior).any() else -math.inf
    above = float(x[~scaled].min()) if (~scaled).any() else 2 * xi
    for t in (0.5, 0.1, 0.01, 0.001):
        high = xi + t * (above - xi)
        low = (xi - s * high) / (1 - s)
        if low > below:
            break
    return low, high


def llama3_rope_scaling(
    r: np.ndarray, theta: float, head_dim: int, path: str
) -> dict[str, Any] | None:
    """Invert ``llama3_factors``; None when every divisor is 1. Only the ratios context/low and
    context/high matter, so the context is fixed at the converter's default and low/high solved."""
    r = np.asarray(r, dtype=np.float64).reshape(-1)
    if r.shape[0] != head_dim // 2:
        raise CheckpointError(
            f"GGUF file {path}: rope_freqs.weight has {r.shape[0]} values, "
            f"want head_dim/2 = {head_dim // 2}"
        )
    factor = _f32(float(r.max()))
    if factor <= 1 + 1e-6:
        return None
    scaled = r > 1 + 1e-6
    interior = scaled & (r < factor * (1 - 1e-6))
    # x = context / wavelength, in which the smoothing is linear
    x = LLAMA3_ORIGINAL_CONTEXT / (2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim))
    if interior.sum() >= 2:
        s = (1 / r[interior] - 1 / factor) / (1 - 1 / factor)
        xi = x[interior]
        slope = (s[-1] - s[0]) / (xi[-1] - xi[0])
        low = float(xi[0] - s[0] / slope)
        high = low + 1 / float(slope)
    elif interior.sum() == 1:  # a small head: one frequency between the bounds
        low, high = _bounds_around(x, r, factor, scaled, interior)
    elif interior.sum() == 0 and (~scaled).any():
        # a sharp step: both bounds between the last scaled and the first unscaled frequency
        high = math.sqrt(x[scaled].max() * x[~scaled].min())
        low = math.sqrt(x[scaled].max() * high)
    else:
        raise CheckpointError(f"GGUF file {path}: rope_freqs.weight is not a Llama-3 RoPE scaling")
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(f"{low:.6g}"),
        "high_freq_factor": float(f"{high:.6g}"),
        "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT,
    }
    if not np.allclose(llama3_factors(theta, head_dim, scaling), r, rtol=1e-4, atol=1e-5):
        raise CheckpointError(f"GGUF file {path}: rope_freqs.weight is not a Llama-3 RoPE scaling")
    return scaling
