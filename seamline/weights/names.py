"""Checkpoint name tables: which Hugging Face tensors fill each Stage parameter.

A ``TensorPlan`` says how one parameter is built: its sources (outer tuple stacked on a new
dim 0 — experts; inner tuple concatenated on dim 0 — fused q/k/v or gate/up), and an
optional slice of each source (ownership: vocabulary rows, feed-forward rows, attention
heads), either one for all sources or one per source of a part (fused q/k/v). The tables
are data: templates with ``{i}`` (layer) and ``{e}`` (expert) filled per owned index.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from seamline.config import ModelConfig
from seamline.ownership import Ownership, Range

L = "model.layers.{i}."


@dataclass(frozen=True)
class TensorPlan:
    target: str  # parameter name in Stage.state_dict()
    parts: tuple[tuple[str, ...], ...]  # stack(cat(part) for part in parts); one part: no stack
    slice_dim: int = 0
    slice: Range | None = None  # applied to every source before concatenation
    stack: bool = False  # parts are stacked on a new dim 0 (one per expert)
    part_slices: tuple[Range | None, ...] | None = None  # per source of each part; overrides slice

    def source_slice(self, position: int) -> Range | None:
        """The slice for the source at ``position`` within its part."""
        return self.part_slices[position] if self.part_slices is not None else self.slice

    def sources(self) -> tuple[str, ...]:
        return tuple(name for part in self.parts for name in part)


# Attention: target suffix -> source templates (concatenated in order).
GQA_TABLE: dict[str, tuple[str, ...]] = {
    "attn.qkv": (
        L + "self_attn.q_proj.weight",
        L + "self_attn.k_proj.weight",
        L + "self_attn.v_proj.weight",
    ),
    "attn.o": (L + "self_attn.o_proj.weight",),
}
GQA_BIAS_TABLE = {
    "attn.qkv_bias": (
        L + "self_attn.q_proj.bias",
        L + "self_attn.k_proj.bias",
        L + "self_attn.v_proj.bias",
    ),
}
QK_NORM_TABLE = {
    "attn.q_norm.weight": (L + "self_attn.q_norm.weight",),
    "attn.k_norm.weight": (L + "self_attn.k_norm.weight",),
}
MLA_TABLE = {
    "attn.kv_a": (L + "self_attn.kv_a_proj_with_mqa.weight",),
    "attn.kv_a_norm.weight": (L + "self_attn.kv_a_layernorm.weight",),
    "attn.kv_b": (L + "self_attn.kv_b_proj.weight",),
    "attn.o": (L + "self_attn.o_proj.weight",),
}
MLA_Q_LORA_TABLE = {
    "attn.q_a": (L + "self_attn.q_a_proj.weight",),
    "attn.q_a_norm.weight": (L + "self_attn.q_a_layernorm.weight",),
    "attn.q_b": (L + "self_attn.q_b_proj.weight",),
}
MLA_Q_TABLE = {"attn.q": (L + "self_attn.q_proj.weight",)}
NORM_TABLE = {
    "input_norm.weight": (L + "input_layernorm.weight",),
    "post_norm.weight": (L + "post_attention_layernorm.weight",),
}
SANDWICH_NORM_TABLE = {  # Gemma 3: its post_attention_layernorm norms the attention's output
    "input_norm.weight": (L + "input_layernorm.weight",),
    "attn_out_norm.weight": (L + "post_attention_layernorm.weight",),
    "post_norm.weight": (L + "pre_feedforward_layernorm.weight",),
    "ffn_out_norm.weight": (L + "post_feedforward_layernorm.weight",),
}
# Dense feed-forward: (gate, up) rows and down columns are sliced by the shard.
MLP_NAMES = (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight", L + "mlp.down_proj.weight")


@dataclass(frozen=True)
class MoeNames:
    """One family's MoE tensor templates: expert and shared are (gate, up, down)."""

    router: str
    bias: str | None
    expert: tuple[str, str, str]
    shared: tuple[str, str, str] | None


def _triple(template: str, parts: tuple[str, str, str]) -> tuple[str, str, str]:
    gate, up, down = (template.replace("{w}", w) for w in parts)
    return gate, up, down


MOE_NAMES: dict[str, MoeNames] = {
    "mixtral": MoeNames(
        L + "block_sparse_moe.gate.weight",
        None,
        _triple(L + "block_sparse_moe.experts.{e}.{w}.weight", ("w1", "w3", "w2")),
        None,
    ),
    "qwen3_moe": MoeNames(
        L + "mlp.gate.weight",
        None,
        _triple(L + "mlp.experts.{e}.{w}_proj.weight", ("gate", "up", "down")),
        None,
    ),
    "deepseek": MoeNames(
        L + "mlp.gate.weight",
        L + "mlp.gate.e_score_correction_bias",
        _triple(L + "mlp.experts.{e}.{w}_proj.weight", ("gate", "up", "down")),
        _triple(L + "mlp.shared_experts.{w}_proj.weight", ("gate", "up", "down")),
    ),
}
MOE_NAMES["glm4_moe"] = MOE_NAMES["deepseek"]  # GLM-4.5 names its MoE as DeepSeek does


def stage_plans(config: ModelConfig, own: Ownership, mtp: bool = False) -> list[TensorPlan]:
    """Every parameter a Stage with this ownership has (``mtp``: and the multi-token-prediction
    layer), and where it comes from."""
    if config.is_v4:
        from seamline.weights.v4_names import v4_plans

        return v4_plans(config, own, mtp)
    plans: list[TensorPlan] = []
    if own.owns_embedding():
        plans.append(TensorPlan("embed", (("model.embed_tokens.weight",),)))
    for i in own.layer_indices():
        plans += _layer_plans(config, i, own)
    if own.owns_head(config):
        plans.append(TensorPlan("norm.weight", (("model.norm.weight",),)))
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        plans.append(TensorPlan("head", ((head,),), slice=own.vocab_range(config)))
    return plans + (mtp_plans(config, own) if mtp else [])


MTP_TABLE = {  # DeepSeek-V3's multi-token-prediction layer, beyond its block: target -> source
    "mtp.enorm.weight": "enorm.weight",
    "mtp.hnorm.weight": "hnorm.weight",
    "mtp.eh_proj": "eh_proj.weight",
    "mtp.norm.weight": "shared_head.norm.weight",
}


def mtp_plans(config: ModelConfig, own: Ownership, embed: bool | None = None) -> list[TensorPlan]:
    """The multi-token-prediction layer's parameters, from the checkpoint's layer
    ``num_hidden_layers`` (its head is the model's own; ``embed``: its own copy of the
    embedding too, which a stage without the model's reads; None: where ``own`` lacks it).
    DeepSeek-V4's are its ``mtp.0.*`` tensors (``v4_names.v4_mtp_plans``)."""
    if config.is_v4:
        from seamline.weights.v4_names import v4_mtp_plans

        return v4_mtp_plans(config, own, embed)
    i = config.num_layers
    plans = [
        TensorPlan(target, ((L.format(i=i) + source,),)) for target, source in MTP_TABLE.items()
    ]
    if embed or (embed is None and not own.owns_embedding()):
        plans.append(TensorPlan("mtp.embed", ((L.format(i=i) + "embed_tokens.weight",),)))
    inner = f"layers.{i}."
    for plan in _layer_plans(config, i, own, moe=config.mtp_moe):
        plans.append(replace(plan, target="mtp.block." + plan.target.removeprefix(inner)))
    return plans


def _fill(table: Mapping[str, tuple[str, ...]], i: int) -> list[TensorPlan]:
    prefix = f"layers.{i}."
    return [
        TensorPlan(prefix + t, (tuple(s.format(i=i) for s in srcs),)) for t, srcs in table.items()
    ]


def _layer_plans(
    config: ModelConfig, i: int, own: Ownership, moe: bool | None = None
) -> list[TensorPlan]:
    plans = _fill(SANDWICH_NORM_TABLE if config.sandwich_norms else NORM_TABLE, i)
    plans += _attention_plans(config, i, own)
    if config.is_moe_layer(i) if moe is None else moe:
        return plans + _moe_plans(config, i, own)
    names = tuple(n.format(i=i) for n in MLP_NAMES)
    return plans + _gated_plans(f"layers.{i}.ffn.", names, own.shard_rows(config.intermediate_size))


# Attention target suffix -> (slice_dim, per-source slices) for a head-split rank.
HeadSlices = dict[str, tuple[int, tuple[Range, ...]]]


def _rows(heads: Range, per_head: int) -> Range:
    return (heads[0] * per_head, heads[1] * per_head)


def _gqa_slices(config: ModelConfig, own: Ownership) -> HeadSlices:
    """q rows of the owned query heads, k/v rows of their KV heads, o columns of the q heads."""
    d = config.head_dim
    q = _rows(own.head_range(config.num_heads), d)
    kv = _rows(own.kv_head_range(config.num_heads, config.num_kv_heads), d)
    sinks = own.head_range(config.num_heads)  # gpt-oss: one per query head
    return {
        "attn.qkv": (0, (q, kv, kv)),
        "attn.qkv_bias": (0, (q, kv, kv)),
        "attn.o": (1, (q,)),
        "attn.sinks": (0, (sinks,)),
    }


def _mla_slices(config: ModelConfig, own: Ownership) -> HeadSlices:
    """q_b (or q) rows and kv_b rows per owned head, o columns; kv_a, q_a, norms replicated."""
    heads = own.head_range(config.num_heads)
    q = _rows(heads, config.qk_nope_head_dim + config.qk_rope_head_dim)
    kv = _rows(heads, config.qk_nope_head_dim + config.v_head_dim)
    o = _rows(heads, config.v_head_dim)
    return {
        "attn.q_b": (0, (q,)),
        "attn.q": (0, (q,)),
        "attn.kv_b": (0, (kv,)),
        "attn.o": (1, (o,)),
    }


def _attention_plans(config: ModelConfig, i: int, own: Ownership) -> list[TensorPlan]:
    if config.is_mla:
        q_table = MLA_Q_LORA_TABLE if config.q_lora_rank else MLA_Q_TABLE
        plans = _fill(MLA_TABLE, i) + _fill(q_table, i)
        return head_sliced(plans, _mla_slices(config, own), own)
    plans = _fill(GQA_TABLE, i) + (_fill(GQA_BIAS_TABLE, i) if config.attention_bias else [])
    if config.attention_sinks:
        plans += _fill({"attn.sinks": (L + "self_attn.sinks",)}, i)
    if config.attention_out_bias and own.shard[0] == 0:  # added once, by a group's rank 0
        plans += _fill({"attn.o_bias": (L + "self_attn.o_proj.bias",)}, i)
    plans = head_sliced(plans, _gqa_slices(config, own), own)
    return plans + (_fill(QK_NORM_TABLE, i) if config.qk_norm else [])  # per-head norms: replicated


def head_sliced(plans: list[TensorPlan], slices: HeadSlices, own: Ownership) -> list[TensorPlan]:
    """Attach per-source head slices to the plans whose target ends in a sliced suffix."""
    if own.shard[1] == 1:
        return plans  # one rank owns every head: read whole tensors
    out = []
    for plan in plans:
        suffix = plan.target.split(".", 2)[2]  # "layers.{i}.attn.qkv" -> "attn.qkv"
        if suffix in slices:
            dim, ranges = slices[suffix]
            plan = replace(plan, slice_dim=dim, part_slices=ranges)
        out.append(plan)
    return out


def _gated_plans(prefix: str, names: tuple[str, ...], rows: Range) -> list[TensorPlan]:
    gate, up, down = names
    return [
        TensorPlan(prefix + "gate_up", ((gate, up),), slice_dim=0, slice=rows),
        TensorPlan(prefix + "down", ((down,),), slice_dim=1, slice=rows),
    ]


def _oss_moe_plans(config: ModelConfig, i: int, own: Ownership) -> list[TensorPlan]:
    """gpt-oss: the router's weight and bias, and the owned experts' matrices and biases (one
    tensor per expert and matrix, as ``HFFolderSource`` lists its stacked ones and GGUF has them)."""
    ours, theirs, experts = (
        f"layers.{i}.ffn.",
        L.format(i=i) + "mlp.",
        range(*own.expert_range(config)),
    )
    plans = [
        TensorPlan(ours + "router", ((theirs + "router.weight",),)),
        TensorPlan(ours + "router_logit_bias", ((theirs + "router.bias",),)),
    ]
    for target, suffix in (("", "weight"), ("_bias", "bias")):
        gate_up = tuple(
            tuple(f"{theirs}experts.{e}.{m}_proj.{suffix}" for m in ("gate", "up")) for e in experts
        )
        down = tuple((f"{theirs}experts.{e}.down_proj.{suffix}",) for e in experts)
        plans += [
            TensorPlan(f"{ours}experts_gate_up{target}", gate_up, stack=True),
            TensorPlan(f"{ours}experts_down{target}", down, stack=True),
        ]
    return plans


def _moe_plans(config: ModelConfig, i: int, own: Ownership) -> list[TensorPlan]:
    if config.family == "gpt_oss":
        return _oss_moe_plans(config, i, own)
    names = MOE_NAMES["deepseek" if config.is_mla else config.family]
    prefix = f"layers.{i}."
    plans = [TensorPlan(prefix + "ffn.router", ((names.router.format(i=i),),))]
    if names.bias is not None and config.topk_method == "noaux_tc":
        plans.append(TensorPlan(prefix + "ffn.router_bias", ((names.bias.format(i=i),),)))
    gate, up, down = names.expert
    experts = range(*own.expert_range(config))

    def fill(template: str, e: int) -> str:
        return template.format(i=i, e=e)

    gate_up = tuple((fill(gate, e), fill(up, e)) for e in experts)
    plans.append(TensorPlan(prefix + "ffn.experts_gate_up", gate_up, stack=True))
    plans.append(
        TensorPlan(
            prefix + "ffn.experts_down", tuple((fill(down, e),) for e in experts), stack=True
        )
    )
    if names.shared is not None and config.n_shared_experts:
        g, u, d = (n.format(i=i) for n in names.shared)
        rows = (
            0,
            config.n_shared_experts * config.moe_intermediate_size,
        )  # whole: see model/moe.py
        plans += _gated_plans(prefix + "ffn.shared.", (g, u, d), rows)
    return plans


def ignorable(name: str, config: ModelConfig) -> bool:
    """Checkpoint tensors that no Stage reads: rotary caches, DeepSeek's next-token layers."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if config.is_v4 and name.startswith("mtp."):
        return True  # V4's multi-token-prediction layers
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) >= config.num_layers
    return False
