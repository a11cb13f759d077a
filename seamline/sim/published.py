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

Hardware is vendor figures times stated efficiencies (``device_speed``); ``seed_check`` prices
V4-Flash split over a DGX Spark and an RTX 5090 against the throughputs measured there.
Pure Python: no torch, no transformers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from seamline.config import ModelConfig
from seamline.mesh.plan.pricing import range_bytes
from seamline.mesh.plan.types import LinkCost, ModelSpec, PlanOptions
from seamline.ownership import Ownership
from seamline.quant.sizes import QUANT_TYPE_NAMES, row_bytes
from seamline.sim.costs import DeviceSpeed, StageCost, frame_bytes, return_bytes
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


# ---- the seed's setup ----------------------------------------------------------------------------

# DeepSeek-V4-Flash over 1 GbE: a DGX Spark holding the embedding and layers [0, SEED_SPLIT), an
# RTX 5090 the rest and the head (the seed's "0-18" on the Spark; its "19-36" ends at the
# model's 43rd layer, 42, here); measured 17.9-22.3 tok/s split (4-20 ms between the two), 23.0
# on the Spark alone, with a model file of 91 GB.
SEED_SPLIT = 19
SEED_LATENCIES_S = (0.004, 0.020)
SEED_SPLIT_TOK_S = (17.9, 22.3)
SEED_SINGLE_TOK_S = 23.0
SEED_FILE_BYTES = 91e9
SEED_TOLERANCE = 0.25
# A ~2-bit file of the size the seed names (80.8 GiB published: routed experts IQ2_XXS for gate
# and up, Q2_K for down): its experts' bytes a weight, for the estimate beside the published mix.
Q2_EXPERT_BYTES = (2 * GGML_QUANT_SIZES[Q.IQ2_XXS][1] / 256 + GGML_QUANT_SIZES[Q.Q2_K][1] / 256) / 3
FP4_HELD_BYTES = 0.5 + 4 / 32  # seamline's fp4 weight: the value and a float32 scale per 32

SEED_ASSUMPTIONS = (
    "model: DeepSeek-V4-Flash as released (43 layers, hidden 4096, 4 hyper-connection streams), routed experts "
    "fp4, attention/shared-expert projections fp8, the rest bf16/fp32, held as seamline holds them (float32 scales)",
    "layers: the seed's Spark 0-18 kept; its 5090 range 19-36 taken to run to the last layer, 42, and the head",
    f"memory: every device reads at {BANDWIDTH_EFFICIENCY:.0%} of its published peak bandwidth",
    f"compute: batched rows at {COMPUTE_EFFICIENCY:.0%} of the dense BF16 tensor peak; a row over B weight bytes "
    "at b bytes a parameter is 2B/b FLOPs",
    "DGX Spark BF16 peak: 1 PFLOP sparse FP4 / 16 = 62.5 TFLOPS (the 5090's published FP4:BF16 ratio)",
    "one stream: each stage's one-row step, a hidden-state frame (4 x 4096 float32 + id) per hop, the token back",
    "1 GbE: 117.7 MB/s of TCP payload; the seed's 4 ms and 20 ms one way",
    "memory fit: weights and a 4096-token KV cache within the planner's capacity (10% headroom); the Spark's "
    "128 GiB and the 5090's 32 GiB whole",
    "no speculative decoding: the multi-token-prediction layer is not held",
    "2-bit estimate: routed experts at 2.25 bits a weight (IQ2_XXS gate/up, Q2_K down, as a published 80.8 GiB "
    "V4-Flash file), everything else as released: the seed's 91 GB and its Spark-alone run fit no fp4 file",
)


def _expert_bytes(spec: ModelSpec, start: int, end: int, share: float) -> float:
    """The routed experts' bytes held over layers [start, end): held - active = experts x (1 - k/E)."""
    held, active = spec.layer_bytes[start:end], spec.active_bytes()[start:end]
    return sum(h - a for h, a in zip(held, active)) / (1.0 - share) if share < 1.0 else 0.0


def stage_cost(
    spec: ModelSpec,
    config: ModelConfig,
    name: str,
    speed: DeviceSpeed,
    start: int,
    end: int,
    options: PlanOptions,
) -> tuple[StageCost, dict[str, Any]]:
    """The StageCost of layers [start, end) on a device, and what it holds and reads."""
    held, kv, read = range_bytes(spec, options, start, end)
    share = config.num_experts_per_tok / config.num_experts if config.num_experts else 1.0
    last = end == spec.num_layers
    cost = StageCost(
        name,
        speed,
        read,
        expert_bytes=_expert_bytes(spec, start, end, share),
        experts=config.num_experts,
        experts_per_token=config.num_experts_per_tok,
        frame_bytes_per_row=0 if last else spec.bytes_per_boundary_per_token,
    )
    return cost, {
        "name": name,
        "layers": [start, end - 1],
        "embedding": start == 0,
        "head": last,
        "weight_bytes": held,
        "expert_bytes": round(cost.expert_bytes),
        "kv_bytes": kv,
        "read_bytes_per_token": read,
    }


def single_stream_s(stages: list[StageCost], link: LinkCost) -> float:
    """Seconds per token of one sequence: every stage's one-row step, a frame over each hop, and
    the drawn token back to stage 0 (none on one machine)."""
    hops = sum(link.seconds(frame_bytes(1, st.frame_bytes_per_row)) for st in stages[:-1])
    back = link.seconds(return_bytes(1)) if len(stages) > 1 else 0.0
    return sum(st.step_s(1) for st in stages) + hops + back


def _fits(facts: dict[str, Any], hw: Hardware, options: PlanOptions) -> dict[str, Any]:
    """``facts`` with the device's capacity and whether the stage fits it, as released and with
    its routed experts at the ~2-bit file's bytes."""
    capacity, kv = options.capacity(hw.memory_bytes), facts["kv_bytes"]
    small = facts["weight_bytes"] - round(
        facts["expert_bytes"] * (1.0 - Q2_EXPERT_BYTES / FP4_HELD_BYTES)
    )
    return {
        **facts,
        "device": hw.name,
        "capacity_bytes": capacity,
        "fits": facts["weight_bytes"] + kv <= capacity,
        "weight_bytes_2bit_experts": small,
        "fits_2bit_experts": small + kv <= capacity,
    }


def _first_fitting(
    spec: ModelSpec,
    config: ModelConfig,
    speed: DeviceSpeed,
    hw: Hardware,
    options: PlanOptions,
    key: str,
) -> int:
    """The first layer from which a last stage (to the head) fits ``hw`` (``key``: which fit)."""
    for start in range(spec.num_layers):
        if _fits(
            stage_cost(spec, config, "", speed, start, spec.num_layers, options)[1], hw, options
        )[key]:
            return start
    return spec.num_layers


def _q2(stage: StageCost) -> StageCost:
    """The stage with its routed experts at the ~2-bit file's bytes a weight (the rest as released)."""
    ratio, share = Q2_EXPERT_BYTES / FP4_HELD_BYTES, stage.experts_per_token / stage.experts
    saved = stage.expert_bytes * share * (1.0 - ratio)
    return StageCost(
        stage.name,
        stage.speed,
        stage.read_bytes - saved,
        expert_bytes=stage.expert_bytes * ratio,
        experts=stage.experts,
        experts_per_token=stage.experts_per_token,
        frame_bytes_per_row=stage.frame_bytes_per_row,
    )


def _prices(
    split: list[StageCost], alone: StageCost, latencies: tuple[float, ...] = SEED_LATENCIES_S
) -> dict[str, Any]:
    """tok/s and ms/token of the split at each one-way latency, and of the Spark alone."""
    out: dict[str, Any] = {}
    for latency in latencies:
        seconds = single_stream_s(split, LinkCost(latency, GBE_BYTES_PER_S))
        key = f"{latency * 1000:g}ms"
        out[f"split_ms_per_token_{key}"], out[f"split_tok_s_{key}"] = seconds * 1000, 1.0 / seconds
    seconds = single_stream_s([alone], LINK_1GBE)
    out["single_ms_per_token"], out["single_tok_s"] = seconds * 1000, 1.0 / seconds
    return out


def _within(prices: dict[str, Any]) -> dict[str, bool]:
    """Whether each prediction lies within SEED_TOLERANCE of the seed's measured range."""

    def near(value: float, lo: float, hi: float) -> bool:
        return lo * (1 - SEED_TOLERANCE) <= value <= hi * (1 + SEED_TOLERANCE)

    out = {k: near(v, *SEED_SPLIT_TOK_S) for k, v in prices.items() if k.startswith("split_tok_s")}
    out["single_tok_s"] = near(prices["single_tok_s"], SEED_SINGLE_TOK_S, SEED_SINGLE_TOK_S)
    return out


def seed_check(split: int = SEED_SPLIT) -> dict[str, Any]:
    """The seed's setup priced analytically (see SEED_ASSUMPTIONS): model facts, each stage's
    bytes and memory fit, predicted tok/s split and alone, for the published mix and for a
    ~2-bit file of the seed's size, against the seed's measurements."""
    checkpoint, options = v4_flash_checkpoint(), PlanOptions()
    spec, config = checkpoint.spec(), checkpoint.config
    per_param = active_bytes_per_param(checkpoint, spec)
    spark, rtx = device_speed(DGX_SPARK, per_param), device_speed(RTX_5090, per_param)
    layers = spec.num_layers
    first, first_facts = stage_cost(spec, config, "dgx-spark", spark, 0, split, options)
    second, second_facts = stage_cost(spec, config, "rtx-5090", rtx, split, layers, options)
    alone, alone_facts = stage_cost(spec, config, "dgx-spark-alone", spark, 0, layers, options)
    split_q2 = [_q2(first), _q2(second)]
    published, q2 = _prices([first, second], alone), _prices(split_q2, _q2(alone))
    mtp = checkpoint.mtp_names()
    return {
        "model": {
            "name": checkpoint.name,
            "layers": layers,
            "hidden": spec.hidden_size,
            "hc_mult": int(config.hf["hc_mult"]),
            "frame_row_bytes": spec.bytes_per_boundary_per_token,
            "held_weight_bytes": spec.weight_bytes(),
            "file_bytes": checkpoint.file_bytes(),
            "file_bytes_without_mtp": checkpoint.file_bytes(set(checkpoint.shapes) - mtp),
            "seed_file_bytes": SEED_FILE_BYTES,
            "active_bytes_per_param": per_param,
        },
        "stages": [_fits(first_facts, DGX_SPARK, options), _fits(second_facts, RTX_5090, options)],
        "single": _fits(alone_facts, DGX_SPARK, options),
        "rtx_5090_fits_from_layer": _first_fitting(spec, config, rtx, RTX_5090, options, "fits"),
        "rtx_5090_fits_from_layer_2bit_experts": _first_fitting(
            spec, config, rtx, RTX_5090, options, "fits_2bit_experts"
        ),
        "assumptions": list(SEED_ASSUMPTIONS),
        "predicted": published,
        "predicted_2bit_experts": q2,
        # the seed's "4-20 ms" read as round trips instead (one way: half)
        "predicted_2bit_experts_if_round_trip": _prices(
            split_q2, _q2(alone), tuple(x / 2 for x in SEED_LATENCIES_S)
        ),
        "seed": {
            "split_tok_s": list(SEED_SPLIT_TOK_S),
            "single_tok_s": SEED_SINGLE_TOK_S,
            "latencies_ms": [x * 1000 for x in SEED_LATENCIES_S],
            "tolerance": SEED_TOLERANCE,
        },
        "within_tolerance": _within(published),
        "within_tolerance_2bit_experts": _within(q2),
    }
