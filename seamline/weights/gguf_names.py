"""GGUF tensor names -> Hugging Face names, as data tables.

llama.cpp names a block's tensors ``blk.{layer}.{key}.{weight|bias}``. A stacked MoE tensor
(``blk.N.ffn_gate_exps.weight``, torch shape ``[E, out, in]``) becomes one HF name per expert;
old Mixtral files store experts one by one as ``blk.N.ffn_gate.{e}.weight``.

DeepSeek-V2/V3 (llama.cpp's ``deepseek2``) add latent-attention and shared-expert keys; newer
files split ``attn_kv_b`` into ``attn_k_b`` + ``attn_v_b``, which ``gguf_mla`` joins back.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# Whole-model tensors.
GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Tensors that describe the model rather than hold weights; config_dict consumes them.
CONSUMED_NAMES: frozenset[str] = frozenset({"rope_freqs.weight"})

# blk.{L}.<key> -> model.layers.{L}.<value>, same for every dense family.
BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",  # Qwen3
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# blk.{L}.<key> -> model.layers.{L}.<value>, added for the DeepSeek families.
MLA_BLOCK_NAMES: dict[str, str] = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")

# GLM-4.5 (glm4moe): its pre-feed-forward norm is post_attention_norm; DeepSeek's shared experts
GLM_BLOCK_NAMES: dict[str, str] = {
    "post_attention_norm": "post_attention_layernorm",
    **{k: v for k, v in MLA_BLOCK_NAMES.items() if k.endswith("_shexp")},
}
# gpt-oss: post_attention_norm before the feed-forward, a sink logit per head (a bare HF name)
OSS_BLOCK_NAMES: dict[str, str] = {"post_attention_norm": "post_attention_layernorm"}

# Gemma 3's four norms a block (llama.cpp's converter writes them as 1 + w, as seamline reads them)
GEMMA_BLOCK_NAMES: dict[str, str] = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# (key, suffix) -> model.layers.{L}.<value>: HF names without a .weight/.bias of their own.
BARE_NAMES: dict[tuple[str, str], str] = {
    ("exp_probs_b", "bias"): "mlp.gate.e_score_correction_bias",  # DeepSeek-V3 router bias
    ("attn_sinks", "weight"): "self_attn.sinks",  # gpt-oss
}
BARE_FAMILIES: dict[tuple[str, str], tuple[str, ...]] = {  # the families that have each
    ("exp_probs_b", "bias"): (
        "deepseek_v2",
        "deepseek_v3",
        "glm4_moe",
    ),  # sigmoid routing's correction bias
    ("attn_sinks", "weight"): ("gpt_oss",),
}

# The halves of a split attn_kv_b; gguf_mla joins them into self_attn.kv_b_proj.
JOINED_KEYS: dict[str, str] = {"attn_k_b": "k", "attn_v_b": "v"}


class GgufMoeNames(NamedTuple):
    router: str  # blk.{L}.ffn_gate_inp -> model.layers.{L}.<router>
    expert: str  # per-expert prefix, formatted with e
    gate: str
    up: str
    down: str


GGUF_MOE_NAMES: dict[str, GgufMoeNames] = {
    "mixtral": GgufMoeNames(
        "block_sparse_moe.gate", "block_sparse_moe.experts.{e}", "w1", "w3", "w2"
    ),
    "qwen3_moe": GgufMoeNames("mlp.gate", "mlp.experts.{e}", "gate_proj", "up_proj", "down_proj"),
    "deepseek_v2": GgufMoeNames("mlp.gate", "mlp.experts.{e}", "gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": GgufMoeNames("mlp.gate", "mlp.experts.{e}", "gate_proj", "up_proj", "down_proj"),
    "glm4_moe": GgufMoeNames("mlp.gate", "mlp.experts.{e}", "gate_proj", "up_proj", "down_proj"),
    "gpt_oss": GgufMoeNames("mlp.router", "mlp.experts.{e}", "gate_proj", "up_proj", "down_proj"),
}

_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z0-9_]+?)(?:\.(\d+))?\.(weight|bias)")
_EXPERT_KEYS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_SPLIT_EXPERT_KEYS = {"ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
# gate -> ffn_gate_exps, for the writer
STACKED_EXPERT_KEYS: dict[str, str] = {proj: key for key, proj in _EXPERT_KEYS.items()}


def block_names(family: str) -> dict[str, str]:
    """The per-block key table of one family."""
    if family == "gemma3_text":
        return {**BLOCK_NAMES, **GEMMA_BLOCK_NAMES}
    if family == "glm4_moe":
        return {**BLOCK_NAMES, **GLM_BLOCK_NAMES}
    if family == "gpt_oss":
        return {**BLOCK_NAMES, **OSS_BLOCK_NAMES}
    return {**BLOCK_NAMES, **MLA_BLOCK_NAMES} if family in MLA_FAMILIES else BLOCK_NAMES


def block_key(gguf_name: str) -> str | None:
    """``blk.3.attn_k_b.weight`` -> ``attn_k_b``; None for a whole-model tensor."""
    m = _BLOCK_RE.fullmatch(gguf_name)
    return m.group(2) if m is not None else None


class HFName(NamedTuple):
    name: str
    expert: int | None  # index into a stacked [E, ...] GGUF tensor, or None


def hf_names(gguf_name: str, family: str, leading: int) -> list[HFName] | None:
    """The HF names one GGUF tensor provides; None when the tables do not know it.

    ``leading`` is the tensor's first torch dimension (the expert count for stacked experts).
    """
    if gguf_name in GLOBAL_NAMES:
        return [HFName(GLOBAL_NAMES[gguf_name], None)]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None:
        return None
    layer, key, expert, suffix = m.group(1), m.group(2), m.group(3), m.group(4)
    prefix = f"model.layers.{layer}."
    moe = GGUF_MOE_NAMES.get(family)
    table = block_names(family)
    if expert is None and key in table:
        return [HFName(f"{prefix}{table[key]}.{suffix}", None)]
    if expert is None and family in BARE_FAMILIES.get((key, suffix), ()):
        return [HFName(prefix + BARE_NAMES[key, suffix], None)]
    if moe is None:
        return None
    if expert is None and key == "ffn_gate_inp":
        return [HFName(f"{prefix}{moe.router}.{suffix}", None)]
    if expert is None and key in _EXPERT_KEYS:
        proj = getattr(moe, _EXPERT_KEYS[key])
        return [
            HFName(f"{prefix}{moe.expert.format(e=e)}.{proj}.{suffix}", e) for e in range(leading)
        ]
    if expert is not None and key in _SPLIT_EXPERT_KEYS:
        proj = getattr(moe, _SPLIT_EXPERT_KEYS[key])
        return [HFName(f"{prefix}{moe.expert.format(e=int(expert))}.{proj}.{suffix}", None)]
    return None
