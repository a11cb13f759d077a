"""Frozen model configuration, built once at the edge from a config.json dict.

Every family seamline runs is described by one ``ModelConfig``; fields a family does not
use keep their defaults. ``from_hf_dict`` is the only place that knows the spellings of
Hugging Face configs (legacy ``rope_scaling`` and newer ``rope_parameters`` alike).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from seamline.config_checks import check_fields
from seamline.errors import ConfigError

DENSE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
MOE_FAMILIES = ("mixtral", "qwen3_moe", "glm4_moe", "gpt_oss")
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
V4_FAMILY = "deepseek_v4"
SUPPORTED_FAMILIES = DENSE_FAMILIES + MOE_FAMILIES + MLA_FAMILIES + (V4_FAMILY,)

# model_type -> when transformers applies config.json's sliding_window (and so does seamline):
# "always": whenever it is set (Mistral, Mixtral); "flag": when use_sliding_window is true
# (Qwen3-MoE: every layer); "layers": when use_sliding_window is true, on the layers that
# layer_types marks "sliding_attention" or, without layer_types, from max_window_layers on
# (Qwen2, Qwen3). Llama and DeepSeek have no sliding window: the field does nothing there.
SLIDING_RULES: dict[str, str] = {
    "mistral": "always",
    "mixtral": "always",
    "qwen3_moe": "flag",
    "qwen2": "layers",
    "qwen3": "layers",
    "gemma3_text": "types",  # layer_types, or every sliding_window_pattern-th layer full
    "gpt_oss": "types",
}
TYPE_PATTERNS = {
    "gemma3_text": 6,
    "gpt_oss": 2,
}  # transformers' defaults without layer_types: every n-th layer full
SLIDING_KIND = "sliding_attention"  # layer_types' name for a windowed layer
DEFAULT_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config / Qwen3Config default


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as found in config.json (``rope_type`` 'default' = none)."""

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 1.0  # yarn (DeepSeek)
    mscale_all_dim: float = 0.0  # yarn (DeepSeek)
    attention_factor: float | None = None  # yarn / longrope override
    truncate: bool = True  # yarn: round the ramp's ends to whole dims (gpt-oss: not)


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3; GLM-4.5's use_qk_norm)
    rotary_dim: int = 0  # the leading dims of each head RoPE turns (partial_rotary_factor; 0: all)
    # Gemma 3: the embedding times sqrt(hidden), norms after attention and the feed-forward too,
    # a GELU-tanh gate, queries scaled by query_pre_attn_scalar, sliding layers on their own RoPE base
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # silu | gelu_tanh
    attention_scale: float = 0.0  # 0: 1 / sqrt(head_dim)
    local_rope_theta: float = 0.0  # the sliding layers' RoPE base (0: the model's)
    # gpt-oss: a learned logit per head in each softmax, a bias on the attention's output, and its
    # experts' clamped SwiGLU (gate and up interleaved, with biases)
    attention_sinks: bool = False
    attention_out_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    # sliding-window attention: a query at position i sees keys (i - sliding_window, i] on these layers
    sliding_window: int = 0
    sliding_layers: frozenset[int] = frozenset()
    # Mixture of experts (Mixtral, Qwen3-MoE, DeepSeek)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()  # indices of layers whose feed-forward is MoE
    # DeepSeek V2/V3
    n_shared_experts: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    scoring_func: str = "softmax"  # softmax | sigmoid | sqrtsoftplus (DeepSeek-V4)
    routed_scaling_factor: float = 1.0
    rope_interleave: bool = False  # DeepSeek's rope dims are stored pairwise-interleaved
    mtp_layers: int = 0  # DeepSeek's multi-token-prediction layers (V3: layer num_layers on; V4: mtp.*), which may draft
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # DeepSeek-V4: its config.json as read; its modules take their many layout fields from it
    hf: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.family in MLA_FAMILIES

    @property
    def is_v4(self) -> bool:
        return self.family == V4_FAMILY

    @property
    def mtp_moe(self) -> bool:
        """Whether the multi-token-prediction layer's feed-forward is MoE (as the last layer's)."""
        return self.is_moe_layer(self.num_layers - 1)

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        family = _family_of(d)
        check_fields(family, d)
        heads = _req(d, "num_attention_heads")
        hidden = _req(d, "hidden_size")
        layers = _req(d, "num_hidden_layers")
        kwargs: dict[str, Any] = dict(
            family=family,
            vocab_size=_req(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=int(d.get("intermediate_size") or 0),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe") or bool(d.get("use_qk_norm", False)),
            rotary_dim=_rotary_dim(d),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_ids(d.get("eos_token_id")),
        )
        kwargs["rope_theta"], kwargs["rope_scaling"] = rope_of(d)
        if family == "gemma3_text":
            kwargs.update(_gemma_fields(d, hidden))
        if family == "gpt_oss":  # attention sinks, the output's bias, the experts' clamped SwiGLU
            kwargs.update(
                attention_sinks=True,
                attention_out_bias=True,
                swiglu_limit=float(d.get("swiglu_limit") or 7.0),
                swiglu_alpha=float(d.get("swiglu_alpha") or 1.702),
            )
        kwargs["sliding_window"], kwargs["sliding_layers"] = sliding_layers(family, d)
        kwargs.update(_moe_fields(family, d, layers))
        if family in MLA_FAMILIES:
            kwargs.update(_mla_fields(d))
        if family == V4_FAMILY:
            kwargs.update(_v4_fields(d, layers))
        return cls(**kwargs)


def _req(d: dict[str, Any], key: str) -> int:
    if key not in d or d[key] is None:
        raise ConfigError(f"config.json has no '{key}'")
    return int(d[key])


def _family_of(d: dict[str, Any]) -> str:
    family = d.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise ConfigError(
            f"unsupported model_type {family!r}; seamline runs {', '.join(SUPPORTED_FAMILIES)}"
        )
    return str(family)


def sliding_window_active(family: str, d: dict[str, Any]) -> bool:
    """Whether transformers would restrict some layer's attention to ``sliding_window`` keys
    within the model's context (a window of max_position_embeddings or more never binds)."""
    window, layers = sliding_layers(family, d)
    return bool(layers) and window < int(d.get("max_position_embeddings", 4096))


def sliding_layers(family: str, d: dict[str, Any]) -> tuple[int, frozenset[int]]:
    """(window, the layers whose attention it restricts) as transformers applies config.json's
    ``sliding_window`` (``SLIDING_RULES``); (0, none) where it applies none."""
    rule, window = SLIDING_RULES.get(family), d.get("sliding_window")
    count = int(d.get("num_hidden_layers", 0))
    if rule is None or window is None or int(window) <= 0:
        return 0, frozenset()
    if rule in ("always", "types"):
        chosen = range(count) if rule == "always" else _sliding_types(d, count)
    elif not d.get("use_sliding_window", False):
        return 0, frozenset()
    elif rule == "flag":
        chosen = range(count)
    elif types := d.get("layer_types"):
        chosen = [i for i in range(count) if types[i] == SLIDING_KIND]
    else:
        chosen = range(int(d.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)), count)
    layers = frozenset(chosen)
    return (int(window), layers) if layers else (0, frozenset())


def _sliding_types(d: dict[str, Any], count: int) -> list[int]:
    """Gemma 3's and gpt-oss's sliding layers: as layer_types says, or all but every n-th."""
    if types := d.get("layer_types"):
        return [i for i in range(count) if types[i] == SLIDING_KIND]
    pattern = int(d.get("sliding_window_pattern") or TYPE_PATTERNS[str(d.get("model_type"))])
    return [i for i in range(count) if (i + 1) % pattern]


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def rope_of(d: dict[str, Any]) -> tuple[float, RopeScaling]:
    """Read rope theta and scaling from either the legacy or the newer config spelling."""
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    params = {**legacy, **params} if params else dict(legacy)
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    known = {f for f in RopeScaling.__dataclass_fields__ if f != "rope_type"}
    values = {k: params[k] for k in known if params.get(k) is not None}
    return theta, RopeScaling(rope_type=str(rope_type), **values)


def _moe_fields(family: str, d: dict[str, Any], layers: int) -> dict[str, Any]:
    if family == "mixtral":
        return dict(
            num_experts=int(d["num_local_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["intermediate_size"]),
            norm_topk_prob=True,
            moe_layers=tuple(range(layers)),
        )
    if family == "qwen3_moe":
        step = int(d.get("decoder_sparse_step", 1) or 1)
        dense_only = set(d.get("mlp_only_layers") or [])
        moe = tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
        # Hub checkpoints say num_experts; transformers 5 writes num_local_experts.
        experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            moe_layers=moe if experts > 0 else (),
        )
    if family == "gpt_oss":  # softmax over the top-k logits of a router with a bias
        return dict(
            num_experts=int(d["num_local_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["intermediate_size"]),
            moe_layers=tuple(range(layers)),
            scoring_func="topk_softmax",
        )
    if family == "glm4_moe":  # DeepSeek-V3's routing: sigmoid scores, a bias, groups by their top-2
        return {
            **_deepseek_moe(d, layers),
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "n_group": int(d.get("n_group") or 1),
            "topk_group": int(d.get("topk_group") or 1),
            "routed_scaling_factor": float(d.get("routed_scaling_factor") or 1.0),
        }
    if family in MLA_FAMILIES:
        return _deepseek_moe(d, layers)
    return {}


def _deepseek_moe(d: dict[str, Any], layers: int) -> dict[str, Any]:
    """DeepSeek's MoE layout (GLM-4.5's too): dense first layers, routed and shared experts."""
    first_dense = int(d.get("first_k_dense_replace", 0) or 0)
    freq = int(d.get("moe_layer_freq", 1) or 1)
    experts = int(d.get("n_routed_experts") or 0)
    moe = tuple(i for i in range(first_dense, layers) if i % freq == 0) if experts else ()
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        moe_layers=moe,
        n_shared_experts=int(d.get("n_shared_experts") or 0),
    )


def _gemma_fields(d: dict[str, Any], hidden: int) -> dict[str, Any]:
    """Gemma 3's text model: what sets it apart from Llama (see the fields' comments); its
    RoPE per layer kind (transformers 5's rope_parameters by layer type, or the older
    rope_theta / rope_scaling / rope_local_base_freq)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(key) is not None:
            raise ConfigError(f"config.json sets {key}; seamline's Gemma 3 has no soft-capping")
    if d.get("use_bidirectional_attention"):
        raise ConfigError(
            "config.json sets use_bidirectional_attention: seamline serves causal models only"
        )
    if (act := d.get("hidden_activation") or "gelu_pytorch_tanh") not in (
        "gelu_pytorch_tanh",
        "gelu_tanh",
    ):
        raise ConfigError(f"hidden_activation {act!r} is not Gemma 3's gelu_pytorch_tanh")
    fields: dict[str, Any] = dict(
        embed_scale=hidden**0.5,
        sandwich_norms=True,
        hidden_act="gelu_tanh",
        qk_norm=True,
        attention_scale=float(d.get("query_pre_attn_scalar") or 256) ** -0.5,
    )
    by_kind = d.get("rope_parameters") or {}
    if "full_attention" in by_kind:
        fields["rope_theta"], fields["rope_scaling"] = rope_of(
            {"rope_parameters": by_kind["full_attention"]}
        )
        local = by_kind.get("sliding_attention") or {}
        fields["local_rope_theta"] = float(
            local.get("rope_theta") or d.get("rope_local_base_freq") or 10000.0
        )
    else:
        fields["local_rope_theta"] = float(d.get("rope_local_base_freq") or 10000.0)
    return fields


def _rotary_dim(d: dict[str, Any]) -> int:
    """The dims of each head RoPE turns: head_dim x partial_rotary_factor (top level or in
    rope_parameters, as transformers 5 writes it); 0 where it turns all of them."""
    factor = (d.get("rope_parameters") or {}).get(
        "partial_rotary_factor", d.get("partial_rotary_factor")
    )
    if factor is None or float(factor) >= 1.0:
        return 0
    head_dim = int(d.get("head_dim") or _req(d, "hidden_size") // _req(d, "num_attention_heads"))
    return int(head_dim * float(factor))


def _mla_fields(d: dict[str, Any]) -> dict[str, Any]:
    family = d["model_type"]
    default_method = "noaux_tc" if family == "deepseek_v3" else "greedy"
    default_scoring = "sigmoid" if family == "deepseek_v3" else "softmax"
    return dict(
        q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
        head_dim=int(d["qk_nope_head_dim"]) + int(d["qk_rope_head_dim"]),
        n_group=int(d.get("n_group") or 1),
        topk_group=int(d.get("topk_group") or 1),
        topk_method=str(d.get("topk_method") or default_method),
        scoring_func=str(d.get("scoring_func") or default_scoring),
        routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
        rope_interleave=bool(d.get("rope_interleave", True)),
        mtp_layers=int(d.get("num_nextn_predict_layers") or 0) if family == "deepseek_v3" else 0,
    )


def _v4_fields(d: dict[str, Any], layers: int) -> dict[str, Any]:
    """DeepSeek-V4: every layer's feed-forward is a mixture of experts, routed by
    sqrt(softplus) scores (or by a token-id table), one shared key/value head."""
    for key in (
        "hc_mult",
        "layer_types",
        "mlp_layer_types",
        "sliding_window",
        "o_groups",
        "o_lora_rank",
    ):
        if d.get(key) is None:
            raise ConfigError(f"config.json has no '{key}' (DeepSeek-V4)")
    for kind in ("layer_types", "mlp_layer_types"):
        if len(d[kind]) < layers:
            raise ConfigError(
                f"config.json's {kind} names {len(d[kind])} layers; the model has {layers}"
            )
    unknown = set(d["layer_types"][:layers]) - set(V4_ATTENTION_KINDS)
    if unknown:
        raise ConfigError(
            f"unknown DeepSeek-V4 layer type {sorted(unknown)[0]!r}; known: {', '.join(V4_ATTENTION_KINDS)}"
        )
    return dict(
        num_kv_heads=1,
        num_experts=int(d["n_routed_experts"]),
        num_experts_per_tok=int(d["num_experts_per_tok"]),
        moe_intermediate_size=int(d["moe_intermediate_size"]),
        norm_topk_prob=True,
        moe_layers=tuple(range(layers)),
        n_shared_experts=int(d.get("n_shared_experts") or 1),
        q_lora_rank=int(d["q_lora_rank"]),
        topk_method="noaux_tc",
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
        mtp_layers=int(d.get("num_nextn_predict_layers") or 0),
        hf=json.loads(json.dumps(d)),
    )


V4_ATTENTION_KINDS = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)


V4_REWIND_REACH = (
    33  # positions a V4 cache can take back: a window of the most drafts (32) and its draw
)


def v4_cache_bytes(
    config: ModelConfig, layers: Sequence[int], tokens: int, dtype_bytes: int
) -> int:
    """The most a V4 sequence of ``tokens`` holds over ``layers``, per layer type: the window's
    last keys (every type), one entry per ``rate`` tokens (compressed types; the sparse type's
    indexer keeps its own), and a compressor's latest rows (candidates and gates: the open
    window's, the last closed window's where windows overlap, two halves wide, as in the sparse
    type), each with ``V4_REWIND_REACH`` more positions kept to rewind a speculative window."""
    hf = config.hf
    head, window = config.head_dim, int(hf["sliding_window"])
    total = 0
    for i in layers:
        kind = (
            hf["layer_types"][i] if i < config.num_layers else "sliding_attention"
        )  # the MTP layer's
        total += min(tokens, max(window - 1, 0) + V4_REWIND_REACH) * head
        if kind == "sliding_attention":
            continue
        sparse = kind == "compressed_sparse_attention"
        rate = int(hf["compress_rates"][kind])
        width = head + (int(hf["index_head_dim"]) if sparse else 0)
        tail = min(tokens, (2 if sparse else 1) * rate - 1 + V4_REWIND_REACH)
        total += tokens // rate * width + 2 * tail * width * (2 if sparse else 1)
    return total * dtype_bytes


V4_PLANNING_TOKENS = 4096  # the context a V4 layer's bytes per token are averaged over
RING_SLACK = (
    32  # a sliding layer keeps its window and this many positions: 16 for rewinds, 16 a block
)


def ring_size(window: int) -> int:
    """The positions a sliding layer of ``window`` keys keeps (``model/cache.py``; 0: no window,
    every position)."""
    return window + RING_SLACK if window else 0


def sliding_layer_kv(config: ModelConfig, dtype_bytes: int, context: int | None) -> tuple[int, ...]:
    """Each layer's KV bytes per token over ``context`` tokens (default ``V4_PLANNING_TOKENS``):
    a sliding layer's ring spread over them, rounded up; () for a model without windows."""
    if not config.sliding_window or not config.sliding_layers:
        return ()
    tokens, full = context or V4_PLANNING_TOKENS, kv_bytes_per_token(config, dtype_bytes)
    held = min(tokens, ring_size(config.sliding_window))
    return tuple(
        -(-full * held // tokens) if i in config.sliding_layers else full
        for i in range(config.num_layers)
    )


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """Per layer: keys and values of every KV head, or MLA's latent plus rotary key (V4: its
    layers' mean over ``V4_PLANNING_TOKENS``, rounded up; ``v4_cache_bytes`` for a context)."""
    if config.is_v4:
        whole = v4_cache_bytes(config, range(config.num_layers), V4_PLANNING_TOKENS, dtype_bytes)
        return -(-whole // (V4_PLANNING_TOKENS * config.num_layers))
    if config.is_mla:
        return (config.kv_lora_rank + config.qk_rope_head_dim) * dtype_bytes
    return 2 * config.num_kv_heads * config.head_dim * dtype_bytes
