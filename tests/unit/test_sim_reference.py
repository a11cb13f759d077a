"""Published models and hardware for the simulator (``sim/published.py``): the literal configs
are transformers' (the released ones), the shapes are the model's, the totals are the published
files', and the seed's setup is priced (``sim/seed_setup.py``)."""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest

from seamline.mesh.plan.pricing import range_bytes
from seamline.mesh.plan.types import PlanOptions
from seamline.ownership import Ownership
from seamline.sim import published as ref
from seamline.sim.seed_setup import seed_check
from seamline.weights.names import stage_plans

GB = 1e9


@pytest.fixture(scope="module")
def v4() -> ref.Checkpoint:
    return ref.v4_flash_checkpoint()


@pytest.fixture(scope="module")
def v3() -> ref.Checkpoint:
    return ref.v3_q4_k_m_checkpoint()


@pytest.fixture(scope="module")
def seed() -> dict[str, Any]:
    return seed_check()


def _same_on_keys(
    literal: dict[str, Any], published: dict[str, Any], skip: tuple[str, ...] = ()
) -> None:
    for key, value in literal.items():
        if key not in skip:
            assert key in published, key
            assert value == published[key], key


def test_v4_flash_config_is_transformers_defaults_with_the_released_layer_types() -> None:
    transformers = pytest.importorskip("transformers")
    published = transformers.DeepseekV4Config().to_dict()
    _same_on_keys(ref.V4_FLASH_CONFIG, published, skip=("layer_types",))
    # the release's compress_ratios, as transformers folds them, are the literal's layer kinds
    released = transformers.DeepseekV4Config(compress_ratios=list(ref.V4_FLASH_COMPRESS_RATIOS))
    assert released.layer_types == ref.V4_FLASH_CONFIG["layer_types"]
    kinds = ref.V4_FLASH_CONFIG["layer_types"]
    assert (
        kinds[:2] == [ref.SLIDING] * 2 and kinds.count(ref.CSA) == 21 and kinds.count(ref.HCA) == 20
    )


def test_v3_config_is_transformers_defaults() -> None:
    transformers = pytest.importorskip("transformers")
    _same_on_keys(ref.V3_CONFIG, transformers.DeepseekV3Config().to_dict())


def test_reference_imports_neither_torch_nor_transformers() -> None:
    code = "import sys, seamline.sim.seed_setup; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def _module_shapes(stage: Any, config: Any, mtp: bool) -> dict[str, tuple[int, ...]]:
    """Each checkpoint tensor's shape as the stage's (meta) parameters take it: a stacked
    target's sources drop its first dim, a fused one's split it evenly (gate and up)."""
    params = {n: tuple(p.shape) for n, p in stage.named_parameters()}
    out = {}
    for plan in stage_plans(config, Ownership.full(config), mtp):
        target = params[plan.target][1:] if plan.stack else params[plan.target]
        for part in plan.parts:
            for name in part:
                out[name] = (target[0] // len(part), *target[1:])
    return out


def test_v4_shapes_are_the_models(v4: ref.Checkpoint) -> None:
    pytest.importorskip("torch")
    from seamline.model.v4_stage import V4Stage

    stage = V4Stage(v4.config, Ownership.full(v4.config), mtp=True)  # meta parameters: no storage
    assert _module_shapes(stage, v4.config, mtp=True) == v4.shapes


def test_v3_shapes_are_the_models(v3: ref.Checkpoint) -> None:
    pytest.importorskip("torch")
    from seamline.model.stage import Stage

    stage = Stage(v3.config, Ownership.full(v3.config))
    assert _module_shapes(stage, v3.config, mtp=False) == v3.shapes


def test_v4_stored_types(v4: ref.Checkpoint) -> None:
    assert v4.types["model.layers.5.ffn.experts.17.w2.weight"] == "float4_e2m1"
    assert v4.types["model.layers.5.attn.wo_a.weight"] == "float8_e4m3"
    assert (
        v4.types["model.layers.4.attn.indexer.wq_b.weight"] == "float8_e4m3"
    )  # a CSA layer's indexer
    assert v4.types["model.layers.4.attn.indexer.weights_proj.weight"] == "bfloat16"
    assert v4.types["head.weight"] == v4.types["model.embed_tokens.weight"] == "bfloat16"
    assert v4.types["model.layers.0.hc_attn_fn"] == "float32"
    # 43 layers and the MTP block, 256 experts, 3 matrices: every routed expert in fp4
    assert sum(t == "float4_e2m1" for t in v4.types.values()) == 44 * 256 * 3


def test_v4_flash_totals(v4: ref.Checkpoint, seed: dict[str, Any]) -> None:
    """A 1:1 GGUF conversion of the released fp4/fp8 codes is published at ~146 GiB (read as GiB:
    an int4/int8 repack of the same release, with bf16 scales and the MTP layer, is ~157 GiB);
    5% leaves room for the rounding and its container, while fp8 experts (x1.9) or bf16 would fail."""
    without_mtp = v4.file_bytes(set(v4.shapes) - v4.mtp_names())
    assert abs(without_mtp / ref.GiB - 146) <= 0.05 * 146
    spec = v4.spec()
    # seamline holds the scales as float32: more than the file, by the experts' 3/32 bytes a weight
    experts = sum(
        math.prod(s) for n, s in v4.shapes.items() if ".experts." in n and n.startswith("model.")
    )
    assert spec.weight_bytes() - without_mtp == pytest.approx(experts * (4 - 1) / 32, rel=0.01)
    # 284B parameters published (the model's, without its multi-token-prediction layer)
    main = set(v4.shapes) - v4.mtp_names()
    assert sum(math.prod(v4.shapes[n]) for n in main) == pytest.approx(284e9, rel=0.01)
    assert (
        seed["model"]["file_bytes"] > 1.5 * seed["model"]["seed_file_bytes"]
    )  # the seed's 91 GB is no fp4 file


def test_v3_q4_k_m_total(v3: ref.Checkpoint) -> None:
    """llama.cpp's published DeepSeek-V3 Q4_K_M is ~404 GB. 3%: rounding and llama.cpp versions
    (a split attn_kv_b changes ~1% of the bytes), while all-Q4_K would be ~7% less."""
    total = v3.spec().weight_bytes()
    assert abs(total / GB - 404) <= 0.03 * 404
    all_q4 = sum(
        ref._file_bytes(s, "Q4_K") if t in ("Q4_K", "Q6_K") else ref._file_bytes(s, t)
        for s, t in zip(v3.shapes.values(), v3.types.values())
    )
    assert all_q4 < 0.95 * total
    assert (
        v3.types["lm_head.weight"] == "Q6_K"
        and v3.types["model.layers.0.self_attn.kv_b_proj.weight"] == "Q6_K"
    )
    assert (
        v3.types["model.layers.8.mlp.experts.0.down_proj.weight"] == "Q4_K"
    )  # not a use-more-bits layer
    assert v3.types["model.layers.60.mlp.experts.0.down_proj.weight"] == "Q6_K"


def test_device_speed_roofline() -> None:
    speed = ref.device_speed(ref.RTX_5090, 0.84)
    assert speed.bytes_per_second == pytest.approx(1792e9 * ref.BANDWIDTH_EFFICIENCY)
    roof = 209.5e12 * ref.COMPUTE_EFFICIENCY * 0.84 / 2
    assert speed.batched[16] == pytest.approx(min(16 * speed.bytes_per_second, roof))
    assert speed.batched[64] == pytest.approx(roof)  # compute-bound at 64 rows
    cpu = ref.device_speed(ref.DESKTOP_CPU, 1.0)
    assert cpu.bytes_per_second == pytest.approx(89.6e9 * ref.BANDWIDTH_EFFICIENCY)


def test_seed_check_fields_and_prediction(seed: dict[str, Any]) -> None:
    assert {
        "model",
        "stages",
        "single",
        "assumptions",
        "predicted",
        "seed",
        "within_tolerance",
    } <= set(seed)
    model = seed["model"]
    assert (model["layers"], model["hidden"], model["frame_row_bytes"]) == (
        43,
        4096,
        4 * 4096 * 4 + 4,
    )
    assert all(isinstance(a, str) and a for a in seed["assumptions"])
    for prices in (seed["predicted"], seed["predicted_2bit_experts"]):
        for key in ("split_tok_s_4ms", "split_tok_s_20ms", "single_tok_s"):
            assert math.isfinite(prices[key]) and prices[key] > 0, key
        assert prices["split_tok_s_4ms"] > prices["split_tok_s_20ms"]
    spark, rtx = seed["stages"]
    assert (
        (spark["layers"], rtx["layers"]) == ([0, 18], [19, 42])
        and spark["embedding"]
        and rtx["head"]
    )
    assert (
        spark["read_bytes_per_token"] + rtx["read_bytes_per_token"]
        == seed["single"]["read_bytes_per_token"]
    )
    assert set(seed["within_tolerance"]) == {"split_tok_s_4ms", "split_tok_s_20ms", "single_tok_s"}


def test_rtx_5090_stage_fit(seed: dict[str, Any]) -> None:
    """The seed's 5090 stage (layers 19-42 and the head) holds ~101 GB as released and ~47 GB with
    2-bit experts: neither fits its 32 GiB. The first layer from which a last stage fits does."""
    rtx = seed["stages"][1]
    capacity = PlanOptions().capacity(32 * ref.GiB)
    assert rtx["capacity_bytes"] == capacity
    assert rtx["fits"] == (rtx["weight_bytes"] + rtx["kv_bytes"] <= capacity)
    assert not rtx["fits"] and not rtx["fits_2bit_experts"]
    assert seed["single"]["fits"] is False  # nor does the release fit one DGX Spark
    spec, start = ref.v4_flash_checkpoint().spec(), seed["rtx_5090_fits_from_layer"]
    held, kv, _ = range_bytes(spec, PlanOptions(), start, 43)
    more, more_kv, _ = range_bytes(spec, PlanOptions(), start - 1, 43)
    assert held + kv <= capacity < more + more_kv
    assert (
        0 < seed["rtx_5090_fits_from_layer_2bit_experts"] < start
    )  # smaller experts: more layers fit
