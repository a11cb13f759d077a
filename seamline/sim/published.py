"""Published models and hardware for the simulator: what a mesh of real machines would do.

Models are built from shapes alone (no weights): a name -> shape and a name -> stored type table
whose names are the loader's (``weights/names.py``, ``weights/v4_names.py``), so that
``ModelSpec.from_checkpoint_shapes`` gives their bytes as seamline would hold them.

* DeepSeek-V4-Flash (``v4_flash_checkpoint``), as released (FP4 + FP8 mixed). Assumed per tensor:
  routed experts ``float4_e2m1`` (a scale per 32 weights of a row); the attention's projections
  (wq_a, wq_b, wkv, wo_a, wo_b), the shared expert's w1/w2/w3, the indexer's wq_b and the
  multi-token-prediction layer's e_proj/h_proj ``float8_e4m3`` (a scale per 128 x 128 block);
  the hyper-connection tensors, sinks, router biases and compressor position biases float32;
  the hash layers' token -> expert table int64; everything else (embedding, head, router,
  compressors, the indexer's weights_proj, norms) bfloat16. The file holds its scales as one
  UE8M0 byte; seamline holds them as float32 (``quant/scaled.py``), so ``file_bytes`` is smaller
  than the spec's bytes.
* DeepSeek-V3 (671B) in llama.cpp's Q4_K_M (``v3_q4_k_m_checkpoint``): ``gguf_policy``'s rule
  (Q6_K for ``attn_kv_b`` and ``ffn_down*`` on the use-more-bits layers and for the head, Q4_K
  else, float32 norms and router), with ``kv_b_proj`` joined as the published files keep it.

Hardware is vendor figures times stated efficiencies (``device_speed``); ``seed_setup.py`` prices
V4-Flash split over a DGX Spark and an RTX 5090 with them. Pure Python: no torch, no
transformers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from gguf import GGMLQuantizationType as Q

from seamline.config import ModelConfig
from seamline.mesh.plan.types import LinkCost, ModelSpec
from seamline.ownership import Ownership
from seamline.quant.sizes import QUANT_TYPE_NAMES, row_bytes
from seamline.sim.costs import DeviceSpeed
from seamline.weights.gguf_names import GLOBAL_NAMES, STACKED_EXPERT_KEYS, block_names
from seamline.weights.gguf_policy import ModelShape, preset_policy
from seamline.weights.names import stage_plans
from seamline.weights.v4_names import MTP_SOURCE

GiB = 1 << 30
CSA, HCA, SLIDING = (
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "sliding_attention",
)
# The released Flash's config.json "compress_ratios" (0: sliding, 4: CSA, 128: HCA): two sliding
# layers, then 4 and 128 alternating. transformers' default layer_types is another schedule.
V4_FLASH_COMPRESS_RATIOS: tuple[int, ...] = (0, 0) + tuple(
    4 if i % 2 == 0 else 128 for i in range(2, 43)
)
_KIND_OF_RATIO = {0: SLIDING, 4: CSA, 128: HCA}

# DeepSeek-V4-Flash's config: transformers' DeepseekV4Config defaults (which are Flash's,
# https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash), but layer_types from the release.
V4_FLASH_CONFIG: dict[str, Any] = dict(
    model_type="deepseek_v4",
    vocab_size=129280,
    hidden_size=4096,
    num_hidden_layers=43,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    moe_intermediate_size=2048,
    n_routed_experts=256,
    num_experts_per_tok=6,
    n_shared_experts=1,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    sliding_window=128,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    compress_rates={CSA: 4, HCA: 128},
    num_nextn_predict_layers=1,
    rms_norm_eps=1e-6,
    max_position_embeddings=1048576,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    partial_rotary_factor=0.125,
    rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
        "compress": {
            "rope_type": "default",
            "rope_theta": 160000.0,
            "partial_rotary_factor": 0.125,
        },
    },
    layer_types=[_KIND_OF_RATIO[r] for r in V4_FLASH_COMPRESS_RATIOS],
    mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 40,
    bos_token_id=0,
    eos_token_id=1,
)

# DeepSeek-V3 (671B): transformers' DeepseekV3Config defaults, its published shapes
V3_CONFIG: dict[str, Any] = dict(
    model_type="deepseek_v3",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
    bos_token_id=0,
    eos_token_id=1,
)

# Bytes per weight in the published V4 file: the value and its UE8M0 scale byte's share
FILE_BYTES_PER_WEIGHT = {
    "float4_e2m1": 0.5 + 1 / 32,
    "float8_e4m3": 1 + 1 / (128 * 128),
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "int64": 8,
}
_GGUF_FLOATS = {Q.F32: "float32", Q.F16: "float16", Q.BF16: "bfloat16"}


@dataclass(frozen=True)
class Checkpoint:
    """A model as shapes: its config, each tensor's shape and stored type (no weights)."""

    name: str
    config: ModelConfig
    shapes: dict[str, tuple[int, ...]]
    types: dict[str, str]

    def spec(self, dtype_bytes: int = 2, context: int | None = None) -> ModelSpec:
        """Its ModelSpec, float weights and KV cache in ``dtype_bytes`` (2: bfloat16 on a GPU)."""
        return ModelSpec.from_checkpoint_shapes(
            self.config, self.name, self.shapes, dtype_bytes, self.types, context
        )

    def file_bytes(self, names: set[str] | None = None) -> int:
        """Bytes of the published file's tensors (``names``; None: all of them)."""
        return sum(_file_bytes(self.shapes[n], self.types[n]) for n in (names or self.shapes))

    def mtp_names(self) -> set[str]:
        """The multi-token-prediction layer's tensors (the spec leaves them out)."""
        layer = f"model.layers.{self.config.num_layers}."
        return {n for n in self.shapes if n.startswith((MTP_SOURCE, layer))}


def _file_bytes(shape: tuple[int, ...], stored: str) -> int:
    if stored in QUANT_TYPE_NAMES:
        return math.prod(shape[:-1]) * row_bytes(Q[stored], shape[-1])
    return math.ceil(math.prod(shape) * FILE_BYTES_PER_WEIGHT[stored])


# ---- DeepSeek-V4-Flash ---------------------------------------------------------------------------

_V4_FP8 = frozenset(
    {
        "attn.wq_a.weight",
        "attn.wq_b.weight",
        "attn.wkv.weight",
        "attn.wo_a.weight",
        "attn.wo_b.weight",
        "ffn.shared_experts.w1.weight",
        "ffn.shared_experts.w2.weight",
        "ffn.shared_experts.w3.weight",
        "attn.indexer.wq_b.weight",
        "e_proj.weight",
        "h_proj.weight",
    }
)
_V4_FP32 = ("hc_", "attn.attn_sink", "ffn.gate.bias", "compressor.ape")


def v4_flash_checkpoint() -> Checkpoint:
    """DeepSeek-V4-Flash as released: every tensor the loader names, its multi-token-prediction
    layer's too (``mtp.0.*``: a sliding-attention block with a learned router)."""
    config = ModelConfig.from_hf_dict(V4_FLASH_CONFIG)
    names = [src for p in stage_plans(config, Ownership.full(config)) for src in p.sources()]
    first = [
        n for n in names if n.startswith("model.layers.0.")
    ]  # a sliding layer's block: the MTP's kind
    mtp_block = [
        MTP_SOURCE + n.removeprefix("model.layers.0.").replace("tid2eid", "bias") for n in first
    ]
    mtp_own = [
        "e_proj.weight",
        "h_proj.weight",
        "enorm.weight",
        "hnorm.weight",
        "norm.weight",
        "hc_head_fn",
        "hc_head_base",
        "hc_head_scale",
    ]
    names += mtp_block + [MTP_SOURCE + n for n in mtp_own]
    shapes = {n: _v4_shape(V4_FLASH_CONFIG, n) for n in names}
    return Checkpoint("DeepSeek-V4-Flash", config, shapes, {n: _v4_type(n) for n in names})


def _v4_key(name: str) -> str:
    """A tensor's name without its layer or expert: ``model.layers.7.ffn.experts.3.w1.weight`` ->
    ``ffn.experts.{e}.w1.weight``."""
    key = re.sub(r"^(model\.layers\.\d+\.|mtp\.0\.|model\.)", "", name)
    return re.sub(r"experts\.\d+\.", "experts.{e}.", key)


def _v4_kind(hf: dict[str, Any], name: str) -> str:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return hf["layer_types"][int(m.group(1))] if m else SLIDING  # the MTP block: sliding


def _v4_shape(hf: dict[str, Any], name: str) -> tuple[int, ...]:
    """A V4 tensor's shape, as the model's modules take it (``model/v4_*.py``)."""
    h, hc, vocab, heads = (
        hf["hidden_size"],
        hf["hc_mult"],
        hf["vocab_size"],
        hf["num_attention_heads"],
    )
    d, top_k = hf["head_dim"], hf["num_experts_per_tok"]
    q, groups, o_rank, experts = (
        hf["q_lora_rank"],
        hf["o_groups"],
        hf["o_lora_rank"],
        hf["n_routed_experts"],
    )
    inter, shared = (
        hf["moe_intermediate_size"],
        hf["moe_intermediate_size"] * hf["n_shared_experts"],
    )
    kind = _v4_kind(hf, name)
    rate, wide = (
        hf["compress_rates"].get(kind, 0),
        (2 * d if kind == CSA else d),
    )  # CSA's windows overlap
    idx_heads, idx_dim, mixes = hf["index_n_heads"], hf["index_head_dim"], (2 + hc) * hc
    table: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (vocab, h),
        "head.weight": (vocab, h),
        "norm.weight": (h,),
        "hc_head.hc_fn": (hc, hc * h),
        "hc_head.hc_base": (hc,),
        "hc_head.hc_scale": (1,),
        "hc_head_fn": (hc, hc * h),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
        "e_proj.weight": (h, h),
        "h_proj.weight": (h, h),
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "hc_attn_fn": (mixes, hc * h),
        "hc_attn_base": (mixes,),
        "hc_attn_scale": (3,),
        "hc_ffn_fn": (mixes, hc * h),
        "hc_ffn_base": (mixes,),
        "hc_ffn_scale": (3,),
        "attn_norm.weight": (h,),
        "ffn_norm.weight": (h,),
        "attn.wq_a.weight": (q, h),
        "attn.q_norm.weight": (q,),
        "attn.wq_b.weight": (heads * d, q),
        "attn.wkv.weight": (d, h),
        "attn.norm.weight": (d,),
        "attn.attn_sink": (heads,),
        "attn.wo_a.weight": (groups * o_rank, heads * d // groups),
        "attn.wo_b.weight": (h, groups * o_rank),
        "ffn.gate.weight": (experts, h),
        "ffn.gate.bias": (experts,),
        "ffn.gate.tid2eid": (vocab, top_k),
        "ffn.shared_experts.w1.weight": (shared, h),
        "ffn.shared_experts.w3.weight": (shared, h),
        "ffn.shared_experts.w2.weight": (h, shared),
        "ffn.experts.{e}.w1.weight": (inter, h),
        "ffn.experts.{e}.w3.weight": (inter, h),
        "ffn.experts.{e}.w2.weight": (h, inter),
        "attn.compressor.wkv.weight": (wide, h),
        "attn.compressor.wgate.weight": (wide, h),
        "attn.compressor.ape": (rate, wide),
        "attn.compressor.norm.weight": (d,),
        "attn.indexer.compressor.wkv.weight": (2 * idx_dim, h),
        "attn.indexer.compressor.wgate.weight": (2 * idx_dim, h),
        "attn.indexer.compressor.ape": (rate, 2 * idx_dim),
        "attn.indexer.compressor.norm.weight": (idx_dim,),
        "attn.indexer.wq_b.weight": (idx_heads * idx_dim, q),
        "attn.indexer.weights_proj.weight": (idx_heads, h),
    }
    return table[_v4_key(name)]


def _v4_type(name: str) -> str:
    key = _v4_key(name)
    if key.startswith("ffn.experts."):
        return "float4_e2m1"
    if key in _V4_FP8:
        return "float8_e4m3"
    if key.endswith("tid2eid"):
        return "int64"
    return "float32" if key.startswith(_V4_FP32) or key.endswith(_V4_FP32) else "bfloat16"


# ---- DeepSeek-V3 in Q4_K_M -----------------------------------------------------------------------


def v3_q4_k_m_checkpoint() -> Checkpoint:
    """DeepSeek-V3's 61 layers and head (no next-token layer: llama.cpp's files leave it out),
    each tensor in the type llama.cpp's Q4_K_M gives it (``gguf_policy.preset_policy``)."""
    config = ModelConfig.from_hf_dict(V3_CONFIG)
    names = [src for p in stage_plans(config, Ownership.full(config)) for src in p.sources()]
    shapes = {n: _v3_shape(V3_CONFIG, n) for n in names}
    policy = preset_policy(
        "Q4_K_M", ModelShape(config.num_layers, config.num_experts, False, config.num_layers)
    )
    types = {}
    for n in names:
        qtype = policy(_v3_gguf_name(n), shapes[n])
        types[n] = qtype.name if qtype.name in QUANT_TYPE_NAMES else _GGUF_FLOATS[qtype]
    return Checkpoint("DeepSeek-V3-Q4_K_M", config, shapes, types)


def _v3_gguf_name(name: str) -> str:
    """The GGUF name llama.cpp gives a V3 tensor (``gguf_names``' tables read backwards)."""
    globals_ = {hf: gg for gg, hf in GLOBAL_NAMES.items()}
    if name in globals_:
        return globals_[name]
    layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()  # type: ignore[union-attr]
    if m := re.fullmatch(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight", rest):
        return f"blk.{layer}.{STACKED_EXPERT_KEYS[m.group(1)]}.weight"
    if rest == "mlp.gate.weight":
        return f"blk.{layer}.ffn_gate_inp.weight"
    if rest == "mlp.gate.e_score_correction_bias":
        return f"blk.{layer}.exp_probs_b.bias"
    stem, _, suffix = rest.rpartition(".")
    key = {hf: gg for gg, hf in block_names("deepseek_v3").items()}[stem]
    return f"blk.{layer}.{key}.{suffix}"


def _v3_shape(hf: dict[str, Any], name: str) -> tuple[int, ...]:
    h, vocab, heads, q = (
        hf["hidden_size"],
        hf["vocab_size"],
        hf["num_attention_heads"],
        hf["q_lora_rank"],
    )
    nope, rope, v, kv = (
        hf["qk_nope_head_dim"],
        hf["qk_rope_head_dim"],
        hf["v_head_dim"],
        hf["kv_lora_rank"],
    )
    inter, moe, experts = (
        hf["intermediate_size"],
        hf["moe_intermediate_size"],
        hf["n_routed_experts"],
    )
    shared = moe * hf["n_shared_experts"]
    table: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, h),
        "lm_head.weight": (vocab, h),
        "model.norm.weight": (h,),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_a_proj.weight": (q, h),
        "self_attn.q_a_layernorm.weight": (q,),
        "self_attn.q_b_proj.weight": (heads * (nope + rope), q),
        "self_attn.kv_a_proj_with_mqa.weight": (kv + rope, h),
        "self_attn.kv_a_layernorm.weight": (kv,),
        "self_attn.kv_b_proj.weight": (heads * (nope + v), kv),
        "self_attn.o_proj.weight": (h, heads * v),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "mlp.gate.weight": (experts, h),
        "mlp.gate.e_score_correction_bias": (experts,),
        "mlp.experts.{e}.gate_proj.weight": (moe, h),
        "mlp.experts.{e}.up_proj.weight": (moe, h),
        "mlp.experts.{e}.down_proj.weight": (h, moe),
        "mlp.shared_experts.gate_proj.weight": (shared, h),
        "mlp.shared_experts.up_proj.weight": (shared, h),
        "mlp.shared_experts.down_proj.weight": (h, shared),
    }
    key = re.sub(r"experts\.\d+\.", "experts.{e}.", re.sub(r"^model\.layers\.\d+\.", "", name))
    return table[key]


# ---- hardware ------------------------------------------------------------------------------------

# Decode kernels reach 60-80% of a memory system's peak (the rest: page and bank switching,
# refresh, kernel tails); 0.7 for every device, so that devices compare by their published peaks.
BANDWIDTH_EFFICIENCY = 0.7
# Batched steps run dequantized weights through matmuls of 16-64 rows, which reach about half
# of the tensor cores' dense peak; 0.5 for every device.
COMPUTE_EFFICIENCY = 0.5
BATCH_ROWS = (16, 64)


@dataclass(frozen=True)
class Hardware:
    """A device as its vendor publishes it."""

    name: str
    memory_bytes: int  # what seamline may fill (the planner keeps its headroom)
    bandwidth_bytes_per_s: float  # peak memory bandwidth
    flops: float  # dense peak at the precision its matmuls run (stated per device)
    source: str = field(default="", compare=False)


# https://www.nvidia.com/en-us/products/workstations/dgx-spark/ : GB10, 128 GB LPDDR5x unified
# memory at 273 GB/s, "up to 1 PFLOP FP4 AI performance" (with sparsity). Assumed: BF16 with
# FP32 accumulate at 1/16 of sparse FP4, the ratio NVIDIA publishes for the RTX 5090 below.
DGX_SPARK = Hardware(
    "DGX Spark (GB10)",
    128 * GiB,
    273e9,
    1e15 / 16,
    "https://www.nvidia.com/en-us/products/workstations/dgx-spark/",
)
# https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/rtx-5090/ : 32 GB GDDR7 (512-bit,
# 28 Gb/s) at 1,792 GB/s; 3,352 AI TOPS (FP4, sparse); the RTX Blackwell architecture whitepaper
# gives 209.5 dense BF16 TFLOPS with FP32 accumulate.
RTX_5090 = Hardware(
    "GeForce RTX 5090",
    32 * GiB,
    1792e9,
    209.5e12,
    "https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/rtx-5090/",
)
# A desktop CPU node, e.g. a Ryzen 9 9950X (its ``source``): 16 cores at 4.3 GHz base, dual-channel
# DDR5-5600 (2 x 8 bytes x 5600 MT/s = 89.6 GB/s theoretical); assumed 64 FP32 FLOPs a cycle a core
# (two 512-bit FMA pipes: 4.4 TFLOPS; its matmuls run in float32) and 64 GiB of DDR5 fitted.
DESKTOP_CPU = Hardware(
    "desktop CPU node (16 cores, DDR5-5600 x2)",
    64 * GiB,
    89.6e9,
    16 * 4.3e9 * 64,
    "https://www.amd.com/en/products/processors/desktops/ryzen/9000-series/amd-ryzen-9-9950x.html",
)

# 1 GbE: 125 MB/s on the wire, of which TCP carries 1448 of every 1538 bytes (1500-byte MTU with
# timestamps, Ethernet framing and gap): 117.7 MB/s; one way 0.5 ms, as the planner's DEFAULT_LINK.
GBE_BYTES_PER_S = 125e6 * 1448 / 1538
LINK_1GBE = LinkCost(latency_s=0.0005, bandwidth_bytes_per_s=GBE_BYTES_PER_S)
# A wide-area link: 20 ms one way, assumed 100 Mb/s (a home uplink) at the same TCP share.
LINK_WAN_20MS = LinkCost(latency_s=0.020, bandwidth_bytes_per_s=12.5e6 * 1448 / 1538)


def device_speed(hw: Hardware, bytes_per_param: float) -> DeviceSpeed:
    """``hw``'s speed on weights of ``bytes_per_param`` bytes a parameter: one row streams them at
    the efficient bandwidth; r rows over B weight bytes take 2 * r * B / bytes_per_param FLOPs,
    so the rate (weight bytes x rows per second) is r x bandwidth until the compute roof
    flops x COMPUTE_EFFICIENCY x bytes_per_param / 2."""
    one_row = hw.bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY
    roof = hw.flops * COMPUTE_EFFICIENCY * bytes_per_param / 2
    return DeviceSpeed(one_row, {rows: min(rows * one_row, roof) for rows in BATCH_ROWS})


def active_bytes_per_param(checkpoint: Checkpoint, spec: ModelSpec) -> float:
    """The layers' weight bytes read per token over the parameters they hold (routed experts at
    their top-k share): what a batched step's FLOPs follow."""
    config = checkpoint.config
    share = config.num_experts_per_tok / config.num_experts if config.num_experts else 1.0
    params = 0.0
    for p in stage_plans(config, Ownership(layers=(0, config.num_layers))):
        if p.target.startswith("layers."):
            routed = p.target.endswith(("experts_gate_up", "experts_down"))
            params += sum(math.prod(checkpoint.shapes[s]) for s in p.sources()) * (
                share if routed else 1.0
            )
    return sum(spec.active_bytes()) / params
