"""Checkpoint name tables: which Hugging Face tensors fill each Stage parameter.

A ``TensorPlan`` says how one parameter is built: its sources (outer tuple stacked on a new
dim 0 — experts; inner tuple concatenated on dim 0 — fused q/k/v or gate/up), and an
optional slice of each source (ownership: vocabulary rows, feed-forward rows). The tables
are data: templates with ``{i}`` (layer) and ``{e}`` (expert) filled per owned index.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from seamline.config import ModelConfig
from seamline.model.ownership import Ownership, Range

L = "model.layers.{i}."


@dataclass(frozen=True)
class TensorPlan:
    target: str  # parameter name in Stage.state_dict()
    parts: tuple[tuple[str, ...], ...]  # stack(cat(part) for part in parts); one part: no stack
    slice_dim: int = 0
    slice: Range | None = None  # applied to every source before concatenation
    stack: bool = False  # parts are stacked on a new dim 0 (one per expert)

    def sources(self) -> tuple[str, ...]:
        return tuple(name for part in self.parts for name in part)


# Attention: target suffix -> source templates (concatenated in order).
GQA_TABLE: dict[str, tuple[str, ...]] = {
    "attn.qkv": (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"),
    "attn.o": (L + "self_attn.o_proj.weight",),
}
GQA_BIAS_TABLE = {
    "attn.qkv_bias": (L + "self_attn.q_proj.bias", L + "self_attn.k_proj.bias", L + "self_attn.v_proj.bias"),
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
    "mixtral": MoeNames(L + "block_sparse_moe.gate.weight", None,
                        _triple(L + "block_sparse_moe.experts.{e}.{w}.weight", ("w1", "w3", "w2")), None),
    "qwen3_moe": MoeNames(L + "mlp.gate.weight", None,
                          _triple(L + "mlp.experts.{e}.{w}_proj.weight", ("gate", "up", "down")), None),
    "deepseek": MoeNames(L + "mlp.gate.weight", L + "mlp.gate.e_score_correction_bias",
                         _triple(L + "mlp.experts.{e}.{w}_proj.weight", ("gate", "up", "down")),
                         _triple(L + "mlp.shared_experts.{w}_proj.weight", ("gate", "up", "down"))),
}  # fmt: skip


def stage_plans(config: ModelConfig, own: Ownership) -> list[TensorPlan]:
    """Every parameter a Stage with this ownership has, and where it comes from."""
    plans: list[TensorPlan] = []
    if own.owns_embedding():
        plans.append(TensorPlan("embed", (("model.embed_tokens.weight",),)))
    for i in own.layer_indices():
        plans += _layer_plans(config, i, own)
    if own.owns_head(config):
        plans.append(TensorPlan("norm.weight", (("model.norm.weight",),)))
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        plans.append(TensorPlan("head", ((head,),), slice=own.vocab_range(config)))
    return plans


def _fill(table: Mapping[str, tuple[str, ...]], i: int) -> list[TensorPlan]:
    prefix = f"layers.{i}."
    return [TensorPlan(prefix + t, (tuple(s.format(i=i) for s in srcs),)) for t, srcs in table.items()]


def _layer_plans(config: ModelConfig, i: int, own: Ownership) -> list[TensorPlan]:
    plans = _fill(NORM_TABLE, i)
    if config.is_mla:
        plans += _fill(MLA_TABLE, i)
        plans += _fill(MLA_Q_LORA_TABLE if config.q_lora_rank else MLA_Q_TABLE, i)
    else:
        plans += _fill(GQA_TABLE, i)
        plans += _fill(GQA_BIAS_TABLE, i) if config.attention_bias else []
        plans += _fill(QK_NORM_TABLE, i) if config.qk_norm else []
    if config.is_moe_layer(i):
        return plans + _moe_plans(config, i, own)
    names = tuple(n.format(i=i) for n in MLP_NAMES)
    return plans + _gated_plans(f"layers.{i}.ffn.", names, own.shard_rows(config.intermediate_size))


def _gated_plans(prefix: str, names: tuple[str, ...], rows: Range) -> list[TensorPlan]:
    gate, up, down = names
    return [
        TensorPlan(prefix + "gate_up", ((gate, up),), slice_dim=0, slice=rows),
        TensorPlan(prefix + "down", ((down,),), slice_dim=1, slice=rows),
    ]


def _moe_plans(config: ModelConfig, i: int, own: Ownership) -> list[TensorPlan]:
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
    plans.append(TensorPlan(prefix + "ffn.experts_down", tuple((fill(down, e),) for e in experts), stack=True))
    if names.shared is not None and config.n_shared_experts:
        g, u, d = (n.format(i=i) for n in names.shared)
        rows = own.shard_rows(config.n_shared_experts * config.moe_intermediate_size)
        plans += _gated_plans(prefix + "ffn.shared.", (g, u, d), rows)
    return plans


def ignorable(name: str, config: ModelConfig) -> bool:
    """Checkpoint tensors that no Stage reads: rotary caches, DeepSeek's next-token layers."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) >= config.num_layers
    return False
