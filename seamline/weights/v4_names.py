"""DeepSeek-V4's checkpoint names: which tensors fill each ``V4Stage`` parameter.

Names are as transformers writes a V4 checkpoint (``model.layers.{i}.attn.wq_a.weight``,
``head.weight``): the original checkpoint's names, most under a ``model.`` prefix. Routed
experts are one tensor each (w1 gate, w3 up, w2 down), stacked per layer here.
"""

from __future__ import annotations

from seamline.config import ModelConfig
from seamline.ownership import Ownership, v4_head_groups
from seamline.weights.names import HeadSlices, TensorPlan, head_sliced

V4_EMBED = "model.embed_tokens.weight"

_BLOCK = {
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "input_norm.weight": "attn_norm.weight",
    "post_norm.weight": "ffn_norm.weight",
    "attn.q_a": "attn.wq_a.weight",
    "attn.q_a_norm": "attn.q_norm.weight",
    "attn.q_b": "attn.wq_b.weight",
    "attn.kv": "attn.wkv.weight",
    "attn.kv_norm": "attn.norm.weight",
    "attn.o_a": "attn.wo_a.weight",
    "attn.o_b": "attn.wo_b.weight",
    "attn.sinks": "attn.attn_sink",
    "ffn.router": "ffn.gate.weight",
    "ffn.shared_down": "ffn.shared_experts.w2.weight",
}
_COMPRESSOR = {
    "kv": "wkv.weight",
    "gate": "wgate.weight",
    "position_bias": "ape",
    "kv_norm": "norm.weight",
}
_INDEXER = {
    "attn.indexer.q_b": "attn.indexer.wq_b.weight",
    "attn.indexer.weights": "attn.indexer.weights_proj.weight",
}


def v4_plans(config: ModelConfig, own: Ownership, mtp: bool = False) -> list[TensorPlan]:
    """Every parameter a V4Stage with this ownership has (``mtp``: and the multi-token-prediction
    layer), and where it comes from."""
    plans: list[TensorPlan] = []
    if own.owns_embedding():
        plans.append(TensorPlan("embed", ((V4_EMBED,),)))
    for i in own.layer_indices():
        plans += head_sliced(_layer_plans(config, i, own), _shard_slices(config, own), own)
    if own.owns_head(config):
        plans += [
            TensorPlan(f"hc_head.{part}", ((f"model.hc_head.hc_{part}",),))
            for part in ("fn", "base", "scale")
        ]
        plans.append(TensorPlan("norm.weight", (("model.norm.weight",),)))
        plans.append(TensorPlan("head", (("head.weight",),), slice=own.vocab_range(config)))
    return plans + (v4_mtp_plans(config, own) if mtp else [])


MTP_SOURCE = (
    "mtp.0."  # DeepSeek-V4's multi-token-prediction layer, in the original checkpoint's spelling
)
_MTP_OWN = {
    "e_proj": "e_proj.weight",
    "h_proj": "h_proj.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head.fn": "hc_head_fn",
    "hc_head.base": "hc_head_base",
    "hc_head.scale": "hc_head_scale",
}


def v4_mtp_plans(
    config: ModelConfig, own: Ownership, embed: bool | None = None
) -> list[TensorPlan]:
    """The multi-token-prediction layer's parameters (``model/v4_mtp.py``): its projections,
    norms and hyper-head, a block of the reference's kinds, and (``embed``; None: where ``own``
    lacks the model's) a copy of the model's embedding."""
    from seamline.model.v4_mtp import MTP_ATTENTION, MTP_FEED_FORWARD

    plans = [
        TensorPlan("mtp." + target, ((MTP_SOURCE + source,),))
        for target, source in _MTP_OWN.items()
    ]
    plans += _block_plans(config, (MTP_ATTENTION, MTP_FEED_FORWARD), own, "mtp.block.", MTP_SOURCE)
    if embed or (embed is None and not own.owns_embedding()):
        plans.append(TensorPlan("mtp.embed", ((V4_EMBED,),)))
    return plans


def _shard_slices(config: ModelConfig, own: Ownership) -> HeadSlices:
    """A lockstep rank's share, by target suffix: (dim, range). Query heads and the output
    projection by whole output groups (``v4_head_groups``), the shared experts' rows; the
    rest of attention (the shared key/value head, compressors, indexer) is whole on every rank."""
    g0, g1 = v4_head_groups(config, own)
    heads_per_group, rank = (
        config.num_heads // int(config.hf["o_groups"]),
        int(config.hf["o_lora_rank"]),
    )
    h0, h1 = g0 * heads_per_group, g1 * heads_per_group
    shared = own.shard_rows(config.moe_intermediate_size * config.n_shared_experts)
    return {
        "attn.q_b": (0, ((h0 * config.head_dim, h1 * config.head_dim),)),
        "attn.sinks": (0, ((h0, h1),)),
        "attn.o_a": (0, ((g0 * rank, g1 * rank),)),
        "attn.o_b": (1, ((g0 * rank, g1 * rank),)),
        "ffn.shared_gate_up": (0, (shared, shared)),
        "ffn.shared_down": (1, (shared,)),
    }


def _layer_plans(config: ModelConfig, i: int, own: Ownership) -> list[TensorPlan]:
    kinds = (config.hf["layer_types"][i], config.hf["mlp_layer_types"][i])
    return _block_plans(config, kinds, own, f"layers.{i}.", f"model.layers.{i}.")


def _block_plans(
    config: ModelConfig, kinds: tuple[str, str], own: Ownership, ours: str, theirs: str
) -> list[TensorPlan]:
    """A block's parameters (``ours``: their prefix) from the checkpoint's (``theirs``)."""
    table = dict(_BLOCK)
    kind = kinds[0]
    if kind != "sliding_attention":
        table.update(
            {f"attn.compressor.{k}": f"attn.compressor.{v}" for k, v in _COMPRESSOR.items()}
        )
    if kind == "compressed_sparse_attention":
        table.update(
            {
                f"attn.indexer.compressor.{k}": f"attn.indexer.compressor.{v}"
                for k, v in _COMPRESSOR.items()
            }
        )
        table.update(_INDEXER)
    hashed = kinds[1] == "hash_moe"
    table["ffn.table" if hashed else "ffn.router_bias"] = (
        "ffn.gate.tid2eid" if hashed else "ffn.gate.bias"
    )
    plans = [TensorPlan(ours + target, ((theirs + source,),)) for target, source in table.items()]
    shared = (theirs + "ffn.shared_experts.w1.weight", theirs + "ffn.shared_experts.w3.weight")
    plans.append(TensorPlan(ours + "ffn.shared_gate_up", (shared,)))
    expert = theirs + "ffn.experts.{e}.{w}.weight"
    experts = range(*own.expert_range(config))
    gate_up = tuple((expert.format(e=e, w="w1"), expert.format(e=e, w="w3")) for e in experts)
    plans.append(TensorPlan(ours + "ffn.experts_gate_up", gate_up, stack=True))
    plans.append(
        TensorPlan(
            ours + "ffn.experts_down",
            tuple((expert.format(e=e, w="w2"),) for e in experts),
            stack=True,
        )
    )
    return plans


def v4_alias(name: str) -> str:
    """A tensor name in the original V4 checkpoint's spelling, as transformers writes it."""
    fixed = {
        "embed.weight": V4_EMBED,
        "norm.weight": "model.norm.weight",
        "hc_head_fn": "model.hc_head.hc_fn",
        "hc_head_base": "model.hc_head.hc_base",
        "hc_head_scale": "model.hc_head.hc_scale",
    }
    if name in fixed:
        return fixed[name]
    return "model." + name if name.startswith("layers.") else name
