"""Write a Hugging Face model as a GGUF file the way llama.cpp's converter and quantiser would.

Tests and benchmarks use it to make GGUF files of models built with transformers (or any
HF folder). Two architectures are written:

* ``llama`` -- Llama, Mistral, and Mixtral (``llama.expert_count > 0``, experts stacked into
  ``ffn_{gate,up,down}_exps``); Q and K rows get llama.cpp's RoPE permutation (the inverse of
  ``gguf.unpermute_rows``); Llama-3 RoPE scaling becomes a ``rope_freqs.weight`` tensor.
* ``deepseek2`` -- DeepSeek-V2/V3, with the metadata of llama.cpp's converter: one latent KV
  head (``key_length`` = kv_lora + rope, the per-head sizes in ``*_mla``), yarn's
  ``mscale_all_dim`` as ``yarn_log_multiplier`` = 0.1 x it, and ``kv_b_proj`` split into
  ``attn_k_b`` + ``attn_v_b`` as current llama.cpp writes it (``kv_b="joined"``: the older
  single ``attn_kv_b``). DeepSeek's q/k rows are not permuted.

Each tensor's type comes from a policy (``gguf_policy``): a preset name ("F32", "Q8_0",
"Q4_0", "Q4_K_M", ...) or a callable ``(gguf_name, torch_shape) -> type``. Tensors are read,
quantised and written one at a time, so a model larger than memory can be written.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from seamline.config import ModelConfig, rope_of
from seamline.quant.quantize import quantize, row_bytes
from seamline.weights.gguf_config import llama3_factors
from seamline.weights.gguf_mla import split_kv_b
from seamline.weights.gguf_names import (
    BARE_FAMILIES,
    BARE_NAMES,
    GGUF_MOE_NAMES,
    GLOBAL_NAMES,
    STACKED_EXPERT_KEYS,
    block_names,
)
from seamline.weights.gguf_policy import ModelShape, TypePolicy, preset_policy

ARCH_OF_FAMILY: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "gemma3_text": "gemma3",
    "glm4_moe": "glm4moe",
    "gpt_oss": "gpt-oss",
}
FILE_TYPES: dict[str, gguf.LlamaFileType] = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
}
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")


@runtime_checkable
class Readable(Protocol):
    """What the writer reads: seamline's TensorSource (names, shape, get) is one."""

    def names(self) -> set[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def get(self, name: str) -> Any: ...


class _DictSource:
    def __init__(self, tensors: Mapping[str, Any]) -> None:
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get(self, name: str) -> Any:
        return self.tensors[name]


@dataclass(frozen=True)
class Planned:
    """One GGUF tensor: its name, torch-order shape, and how to build its float32 values."""

    name: str
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]


def write_gguf(
    path: str | Path,
    config: Mapping[str, Any],
    tensors: Readable | Mapping[str, Any],
    types: str | TypePolicy = "F32",
    *,
    tokenizer_from: str | Path | None = None,
    kv_b: str = "split",
    name: str = "seamline",
) -> Path:
    """Write ``tensors`` (HF names -> float tensors/arrays, or a TensorSource) of the model that
    ``config`` (a config.json dict) describes to ``path``; returns the path.

    ``tokenizer_from``: a GGUF file whose ``tokenizer.*`` metadata is copied (its token count
    must equal the model's vocab_size). ``kv_b``: "split" (attn_k_b + attn_v_b) or "joined".
    """
    cfg = dict(config)
    family = str(cfg.get("model_type"))
    if family not in ARCH_OF_FAMILY:
        raise ValueError(f"write_gguf writes {', '.join(ARCH_OF_FAMILY)}, not {family!r}")
    if kv_b not in ("split", "joined"):
        raise ValueError(f"kv_b must be 'split' or 'joined', not {kv_b!r}")
    source: Readable = tensors if isinstance(tensors, Readable) else _DictSource(tensors)
    plan = plan_tensors(cfg, source, kv_b)
    policy = types if callable(types) else preset_policy(types, model_shape(cfg, plan))
    arch = ARCH_OF_FAMILY[family]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    writers = {
        "deepseek2": _deepseek_meta,
        "gemma3": _gemma_meta,
        "glm4moe": _glm_meta,
        "gpt-oss": _oss_meta,
    }
    writers.get(arch, _llama_meta)(w, cfg)
    preset = types if isinstance(types, str) else ""
    w.add_file_type(FILE_TYPES.get(preset, gguf.LlamaFileType.GUESSED))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer_from is not None:
        copy_tokenizer(w, Path(tokenizer_from), int(cfg["vocab_size"]))
    else:
        _special_ids(w, cfg)
    chosen = [(p, Q(policy(p.name, p.shape))) for p in plan]
    for p, qtype in chosen:
        byte_shape = (*p.shape[:-1], row_bytes(qtype, p.shape[-1]))
        w.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for p, qtype in chosen:
        values = p.read()
        if tuple(values.shape) != p.shape:
            raise ValueError(f"tensor {p.name} has shape {values.shape}, planned {p.shape}")
        data = quantize(values.reshape(-1, p.shape[-1]), qtype)
        w.write_tensor_data(data.reshape(*p.shape[:-1], -1))
    w.close()
    return Path(path)


def write_gguf_from_folder(
    folder: str | Path, path: str | Path, types: str | TypePolicy = "F32", **kwargs: Any
) -> Path:
    """``write_gguf`` of a Hugging Face folder (config.json + safetensors), read lazily."""
    from seamline.weights.safetensors import HFFolderSource

    source = HFFolderSource(folder)
    return write_gguf(path, source.config_dict(), source, types, **kwargs)


def model_shape(cfg: Mapping[str, Any], plan: list[Planned]) -> ModelShape:
    layers = int(cfg["num_hidden_layers"])
    experts = int(cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    names = {p.name for p in plan}
    values = sum(1 for n in names if n.endswith(("attn_v.weight", "attn_kv_b.weight")))
    return ModelShape(layers, experts, "output.weight" not in names, values)


# ---- tensors: HF names -> GGUF names and layouts ------------------------------------------


def _float(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float32).cpu().numpy()
    return np.asarray(value, dtype=np.float32)


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K permutation: each head's two rotary halves become interleaved pairs."""
    rows = w.shape[0]
    # [rows, *rest] -> [heads, 2, half, *rest] -> [heads, half, 2, *rest] -> [rows, *rest]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def plan_tensors(cfg: Mapping[str, Any], src: Readable, kv_b: str = "split") -> list[Planned]:
    """Every GGUF tensor of the model, in llama.cpp's order (globals, then layer by layer)."""
    family = str(cfg["model_type"])
    layers = int(cfg["num_hidden_layers"])
    tied = bool(cfg.get("tie_word_embeddings", False))
    single: list[Planned] = []
    experts: dict[
        tuple[int, str, str], dict[int, str]
    ] = {}  # (layer, proj, weight|bias) -> expert -> HF name
    for hf in sorted(src.names()):
        if hf.endswith("rotary_emb.inv_freq") or (hf == "lm_head.weight" and tied):
            continue
        m = _HF_BLOCK.fullmatch(hf)
        if m is not None and int(m.group(1)) >= layers:
            continue  # DeepSeek's next-token-prediction layers: llama.cpp skips them too
        expert = _expert_of(family, hf)
        if expert is not None:
            layer, proj, e, suffix = expert
            experts.setdefault((layer, proj, suffix), {})[e] = hf
            continue
        single += _single(cfg, family, src, hf, kv_b)
    single += [
        _stacked(src, layer, proj, by_e, suffix) for (layer, proj, suffix), by_e in experts.items()
    ]
    single += _rope_freqs(cfg, family)
    return sorted(single, key=_order)


def _order(p: Planned) -> tuple[int, str]:
    if p.name.startswith("blk."):
        return (int(p.name.split(".")[1]) + 1, p.name)
    first = p.name in ("token_embd.weight", "rope_freqs.weight")
    return (0 if first else 1 << 30, p.name)


def _expert_of(family: str, hf: str) -> tuple[int, str, int, str] | None:
    """(layer, gate|up|down, expert, weight|bias) of one expert's tensor."""
    moe = GGUF_MOE_NAMES.get(family)
    m = _HF_BLOCK.fullmatch(hf)
    if moe is None or m is None:
        return None
    pattern = re.escape(moe.expert).replace(re.escape("{e}"), r"(\d+)")
    projs = {moe.gate: "gate", moe.up: "up", moe.down: "down"}
    e = re.fullmatch(pattern + r"\.(\w+)\.(weight|bias)", m.group(2))
    if e is None or e.group(2) not in projs:
        return None
    return int(m.group(1)), projs[e.group(2)], int(e.group(1)), e.group(3)


def _gguf_name(family: str, hf: str) -> str:
    for gguf_name, hf_name in GLOBAL_NAMES.items():
        if hf == hf_name:
            return gguf_name
    m = _HF_BLOCK.fullmatch(hf)
    if m is None:
        raise ValueError(f"no GGUF name for tensor {hf} ({family})")
    layer, rest = m.group(1), m.group(2)
    for (key, suffix), bare in BARE_NAMES.items():
        if rest == bare and family in BARE_FAMILIES[key, suffix]:
            return f"blk.{layer}.{key}.{suffix}"
    stem, _, suffix = rest.rpartition(".")
    moe = GGUF_MOE_NAMES.get(family)
    if moe is not None and stem == moe.router:
        return f"blk.{layer}.ffn_gate_inp.{suffix}"
    for key, hf_stem in block_names(family).items():
        if stem == hf_stem:
            return f"blk.{layer}.{key}.{suffix}"
    raise ValueError(f"no GGUF name for tensor {hf} ({family})")


def _single(
    cfg: Mapping[str, Any], family: str, src: Readable, hf: str, kv_b: str
) -> list[Planned]:
    name = _gguf_name(family, hf)
    shape = tuple(src.shape(hf))
    key = name.split(".")[2] if name.startswith("blk.") else ""
    if key == "attn_kv_b" and kv_b == "split":
        return _split_kv_b(cfg, src, hf, name, shape)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg.get("num_key_value_heads")}
    if ARCH_OF_FAMILY[family] == "llama" and key in heads:
        count = int(heads[key] or cfg["num_attention_heads"])
        return [Planned(name, shape, lambda: permute_rows(_float(src.get(hf)), count))]
    return [Planned(name, shape, lambda: _float(src.get(hf)))]


def _split_kv_b(
    cfg: Mapping[str, Any], src: Readable, hf: str, name: str, shape: tuple[int, ...]
) -> list[Planned]:
    heads, nope = int(cfg["num_attention_heads"]), int(cfg["qk_nope_head_dim"])
    v, lora = int(cfg["v_head_dim"]), shape[1]
    if shape[0] != heads * (nope + v):
        raise ValueError(
            f"{hf} has {shape[0]} rows, want heads x (nope + v) = {heads * (nope + v)}"
        )

    def half(which: int) -> Callable[[], np.ndarray]:
        return lambda: split_kv_b(_float(src.get(hf)), heads, nope)[which]

    base = name.removesuffix("attn_kv_b.weight")
    return [
        Planned(base + "attn_k_b.weight", (heads, lora, nope), half(0)),
        Planned(base + "attn_v_b.weight", (heads, v, lora), half(1)),
    ]


def _stacked(
    src: Readable, layer: int, proj: str, by_expert: dict[int, str], suffix: str = "weight"
) -> Planned:
    count = len(by_expert)
    if sorted(by_expert) != list(range(count)):
        raise ValueError(
            f"layer {layer} {proj}: experts {sorted(by_expert)} are not 0..{count - 1}"
        )
    first = tuple(src.shape(by_expert[0]))

    def read() -> np.ndarray:
        return np.stack([_float(src.get(by_expert[e])) for e in range(count)])

    return Planned(f"blk.{layer}.{STACKED_EXPERT_KEYS[proj]}.{suffix}", (count, *first), read)


def _rope_freqs(cfg: Mapping[str, Any], family: str) -> list[Planned]:
    """Llama-3 RoPE scaling: llama.cpp keeps per-frequency divisors in a tensor."""
    theta, scaling = rope_of(dict(cfg))
    if scaling.rope_type != "llama3" or ARCH_OF_FAMILY[family] != "llama":
        return []
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    params = {
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings or 8192,
    }
    freqs = llama3_factors(theta, head_dim, params).astype(np.float32)
    return [Planned("rope_freqs.weight", freqs.shape, lambda: freqs)]


# ---- metadata ------------------------------------------------------------------------------


def _common_meta(w: gguf.GGUFWriter, cfg: Mapping[str, Any], kv_heads: int) -> None:
    w.add_context_length(int(cfg.get("max_position_embeddings", 4096)))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_feed_forward_length(int(cfg.get("intermediate_size") or 0))
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(int(cfg["vocab_size"]))
    theta, _ = rope_of(dict(cfg))
    w.add_rope_freq_base(theta)


def _rope_meta(w: gguf.GGUFWriter, cfg: Mapping[str, Any]) -> None:
    _, s = rope_of(dict(cfg))
    if s.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(s.factor)
    elif s.rope_type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.factor)
        if s.original_max_position_embeddings is None:
            raise ValueError("yarn rope scaling needs original_max_position_embeddings")
        w.add_rope_scaling_orig_ctx_len(int(s.original_max_position_embeddings))
        w.add_rope_scaling_yarn_beta_fast(s.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(s.beta_slow)
    elif s.rope_type not in ("default", "llama3"):
        raise ValueError(f"write_gguf does not write rope scaling {s.rope_type!r}")


def _llama_meta(w: gguf.GGUFWriter, cfg: Mapping[str, Any]) -> None:
    heads = int(cfg["num_attention_heads"])
    _common_meta(w, cfg, int(cfg.get("num_key_value_heads") or heads))
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    _rope_meta(w, cfg)
    experts = int(cfg.get("num_local_experts") or 0)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    window = cfg.get("sliding_window")
    if cfg["model_type"] in ("mistral", "mixtral") and window:
        w.add_sliding_window(int(window))  # transformers applies it; the reader carries it


def _gemma_meta(w: gguf.GGUFWriter, cfg: Mapping[str, Any]) -> None:
    """Gemma 3: its full layers' RoPE as the model's (llama.cpp fixes the sliding layers' base at
    10000 and the pattern at 6, and reads query_pre_attn_scalar from the size)."""
    config = ModelConfig.from_hf_dict(dict(cfg))
    if config.local_rope_theta != 10000.0 or config.sliding_layers != frozenset(
        i for i in range(config.num_layers) if (i + 1) % 6
    ):
        raise ValueError(
            "write_gguf writes Gemma 3 with llama.cpp's fixed sliding layers (base 10000, every 6th full)"
        )
    scaling = {"rope_type": config.rope_scaling.rope_type, "factor": config.rope_scaling.factor}
    _llama_meta(
        w,
        {**cfg, "rope_parameters": None, "rope_theta": config.rope_theta, "rope_scaling": scaling},
    )
    w.add_sliding_window(config.sliding_window)


def _glm_meta(w: gguf.GGUFWriter, cfg: Mapping[str, Any]) -> None:
    """GLM-4.5 as llama.cpp's converter describes it (without its multi-token-prediction layers)."""
    config = ModelConfig.from_hf_dict(dict(cfg))
    _common_meta(w, cfg, config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.rotary_dim or config.head_dim)
    _rope_meta(w, cfg)
    w.add_leading_dense_block_count(min(config.moe_layers, default=config.num_layers))
    w.add_expert_feed_forward_length(config.moe_intermediate_size)
    w.add_expert_count(config.num_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_expert_shared_count(config.n_shared_experts)
    w.add_expert_weights_scale(config.routed_scaling_factor)
    w.add_expert_weights_norm(config.norm_topk_prob)
    w.add_expert_group_count(config.n_group)
    w.add_expert_group_used_count(config.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _oss_meta(w: gguf.GGUFWriter, cfg: Mapping[str, Any]) -> None:
    """gpt-oss as llama.cpp describes it (its layer pattern and SwiGLU limits are llama.cpp's own)."""
    config = ModelConfig.from_hf_dict(dict(cfg))
    _common_meta(w, cfg, config.num_kv_heads)
    for add in (w.add_key_length, w.add_value_length, w.add_rope_dimension_count):
        add(config.head_dim)
    _rope_meta(w, cfg)
    w.add_expert_count(config.num_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_expert_feed_forward_length(config.moe_intermediate_size)
    w.add_sliding_window(config.sliding_window)


def _deepseek_meta(w: gguf.GGUFWriter, cfg: Mapping[str, Any]) -> None:
    _check_deepseek(cfg)
    v3 = cfg["model_type"] == "deepseek_v3"
    _common_meta(w, cfg, 1)  # llama.cpp runs latent attention as one shared KV head
    lora, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    w.add_leading_dense_block_count(int(cfg.get("first_k_dense_replace") or 0))
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(int(cfg["q_lora_rank"]))
    w.add_kv_lora_rank(lora)
    w.add_key_length(lora + rope)
    w.add_value_length(lora)
    w.add_key_length_mla(int(cfg["qk_nope_head_dim"]) + rope)
    w.add_value_length_mla(int(cfg["v_head_dim"]))
    w.add_rope_dimension_count(rope)
    w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    w.add_expert_count(int(cfg.get("n_routed_experts") or 0))
    w.add_expert_used_count(int(cfg.get("num_experts_per_tok") or 0))
    w.add_expert_shared_count(int(cfg.get("n_shared_experts") or 0))
    w.add_expert_weights_scale(float(cfg.get("routed_scaling_factor") or 1.0))
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_expert_group_count(int(cfg.get("n_group") or 1))
    w.add_expert_group_used_count(int(cfg.get("topk_group") or 1))
    sigmoid = v3 or cfg.get("scoring_func") == "sigmoid"
    gating = gguf.ExpertGatingFuncType
    w.add_expert_gating_func(gating.SIGMOID if sigmoid else gating.SOFTMAX)
    _rope_meta(w, cfg)
    _, s = rope_of(dict(cfg))
    if s.rope_type == "yarn" and s.mscale_all_dim:
        w.add_rope_scaling_yarn_log_mul(0.1 * s.mscale_all_dim)


def _check_deepseek(cfg: Mapping[str, Any]) -> None:
    """Refuse what llama.cpp's deepseek2 metadata cannot say (the reader would run it otherwise)."""
    _, s = rope_of(dict(cfg))
    if s.rope_type == "yarn" and (s.mscale or 0) != (s.mscale_all_dim or 0):
        raise ValueError(
            f"deepseek2 GGUF keeps only mscale_all_dim; mscale {s.mscale} != {s.mscale_all_dim}"
        )
    if cfg.get("rope_interleave") is False:
        raise ValueError("deepseek2 GGUF rotates interleaved pairs, not rope_interleave=false")
    if int(cfg.get("moe_layer_freq") or 1) != 1:
        raise ValueError("deepseek2 GGUF has every layer after the leading dense ones MoE")
    groups, used = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    greedy = cfg.get("topk_method", "greedy") == "greedy" and cfg["model_type"] == "deepseek_v2"
    if greedy and 1 < groups and used < groups:
        raise ValueError("a greedy router with limiting groups reads back as group_limited_greedy")


def _special_ids(w: gguf.GGUFWriter, cfg: Mapping[str, Any]) -> None:
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(int(cfg["bos_token_id"]))
    eos = cfg.get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is not None:
        w.add_eos_token_id(int(eos))


def copy_tokenizer(w: gguf.GGUFWriter, source: Path, vocab_size: int) -> None:
    """Copy every ``tokenizer.*`` key of ``source`` with its GGUF value types."""
    reader = gguf.GGUFReader(str(source))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != vocab_size:
        count = None if tokens is None else len(tokens.data)
        raise ValueError(f"{source} has {count} tokens; the model's vocab_size is {vocab_size}")
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
