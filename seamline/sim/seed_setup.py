"""The seed's setup priced: DeepSeek-V4-Flash split over a DGX Spark and an RTX 5090 on 1 GbE,
from the published model and hardware (``published.py``), against the throughputs measured there.

``seed_check`` gives the model's facts, each stage's bytes and memory fit, and the predicted tok/s
split and alone, for the published mix and for a ~2-bit file of the seed's size (see
SEED_ASSUMPTIONS). Pure Python: no torch, no transformers.
"""

from __future__ import annotations

from typing import Any

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from seamline.config import ModelConfig
from seamline.mesh.plan.pricing import range_bytes
from seamline.mesh.plan.types import LinkCost, ModelSpec, PlanOptions
from seamline.sim.costs import DeviceSpeed, StageCost, frame_bytes, return_bytes
from seamline.sim.published import (
    BANDWIDTH_EFFICIENCY,
    COMPUTE_EFFICIENCY,
    DGX_SPARK,
    GBE_BYTES_PER_S,
    LINK_1GBE,
    RTX_5090,
    Hardware,
    active_bytes_per_param,
    device_speed,
    v4_flash_checkpoint,
)

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
