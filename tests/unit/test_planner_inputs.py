"""The planner's inputs and its lock: model specs from checkpoints (embedded, MLA, quantized), the
nodes file, measured rates steadied, the plan command and a stale lock."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from seamline.config import ModelConfig
from seamline.mesh.control.plan_cli import parse_pool, run_plan_command
from seamline.mesh.plan.planner import check_plan, plan
from seamline.mesh.plan.types import (
    HEAD_ROW_SHARE,
    LinkCost,
    LinkTable,
    ModelSpec,
    NodeInfo,
    Plan,
    PlanError,
    PlanOptions,
)
from seamline.ownership import Ownership
from seamline.weights.names import stage_plans
from tests.support.planner import EXACT, MIB, assert_valid, node, spec

GIB = 1 << 30


def test_check_plan_refuses_a_stale_lock() -> None:
    model = spec(20, kv=1024)
    nodes = [node("a", 12 * 100 * MIB), node("b", 12 * 100 * MIB)]
    p = plan(model, nodes, None, EXACT)
    check_plan(p, model, nodes, EXACT)  # still good
    with pytest.raises(PlanError, match="not in the pool"):
        check_plan(p, model, nodes[:1] + [node("c", 30 * GIB)], EXACT)
    with pytest.raises(PlanError, match="no longer fits"):
        check_plan(p, model, [node("a", 2 * 100 * MIB), nodes[1]], EXACT)
    with pytest.raises(PlanError, match="no longer fits"):  # a longer context needs more KV cache
        check_plan(
            p,
            model,
            nodes,
            PlanOptions(context_tokens=10**6, headroom_fraction=0, headroom_bytes=0),
        )
    with pytest.raises(PlanError, match="locked plan is for model"):
        check_plan(p, spec(21, kv=1024), nodes, EXACT)
    gap = Plan.from_json(p.to_json().replace(f'"start": {p.stages[1].start}', '"start": 1'))
    with pytest.raises(PlanError, match="contiguous"):
        check_plan(gap, model, nodes, EXACT)


def test_model_spec_from_the_embedded_checkpoint() -> None:
    from seamline.app import default_model_path
    from seamline.weights.loader import open_source

    source = open_source(default_model_path())
    config = ModelConfig.from_hf_dict(source.config_dict())
    shapes = {n: source.shape(n) for n in source.names()}
    model = ModelSpec.from_checkpoint_shapes(config, "smollm2", shapes, 4)
    assert model.num_layers == 30 and len(set(model.layer_bytes)) == 1
    assert model.weight_bytes() == 4 * sum(math.prod(s) for s in shapes.values())  # tied: once
    assert model.kv_bytes_per_token_per_layer == 2 * config.num_kv_heads * config.head_dim * 4
    assert model.bytes_per_boundary_per_token == config.hidden_size * 4
    options = PlanOptions(context_tokens=2048)
    half = options.headroom_bytes + model.weight_bytes() * 6 // 10 + 30 * 2048 * 1536
    nodes = [node("a", half, 2e10), node("b", half, 2e10)]
    p = plan(model, nodes, None, options)
    assert len(p.stages) == 2
    assert_valid(p, model, nodes, options)


def _embedded_spec() -> ModelSpec:
    """The embedded GGUF as the planner sees it, with bfloat16 activations."""
    from seamline.app import default_model_path
    from seamline.weights.loader import open_source

    source = open_source(default_model_path())
    config = ModelConfig.from_hf_dict(source.config_dict())
    shapes = {n: tuple(source.shape(n)) for n in source.names()}
    return ModelSpec.from_checkpoint_shapes(
        config, "smollm2", shapes, 2, {n: source.stored_type(n) for n in shapes}
    )


def test_under_load_the_head_counts_its_parameters_for_the_rows_that_reach_it() -> None:
    """The embedded GGUF's Q8_0 head holds the bytes of 13 of its Q4_1 layers, but under a
    batched load it costs per row what as many Q4_1 parameters do, for half the rows: about 4
    layers. Two equal nodes then split 17 + 13 (bytes would say 22 + 8), and their work under
    load evens out to within one layer."""
    from seamline.app import default_model_path
    from seamline.weights.loader import open_source

    source = open_source(default_model_path())
    config = ModelConfig.from_hf_dict(source.config_dict())
    shapes = {n: tuple(source.shape(n)) for n in source.names()}
    model = _embedded_spec()
    layer_params = sum(
        math.prod(shape) for n, shape in shapes.items() if n.startswith("model.layers.0.")
    )
    head_params = (
        config.vocab_size * config.hidden_size + config.hidden_size
    )  # the tied head and the final norm
    expected = head_params * model.layer_bytes[0] / layer_params * HEAD_ROW_SHARE
    assert model.head_load() == pytest.approx(expected, rel=1e-3)
    assert (
        model.head_bytes > 12 * model.layer_bytes[0]
        and 3.5 < model.head_load() / model.layer_bytes[0] < 4.5
    )
    nodes = [node("a", 1 << 32, 5e9), node("b", 1 << 32, 5e9)]
    p = plan(model, nodes, None, PlanOptions(context_tokens=2048))
    assert [s.end - s.start for s in p.stages] == [17, 13]
    loads = [s.load_s for s in p.stages]
    assert max(loads) - min(loads) <= model.layer_bytes[0] / 5e9
    assert p.slowest_stage_s() == max(loads)


def test_model_spec_counts_mla_kv_and_active_experts() -> None:
    config = ModelConfig.from_hf_dict(
        dict(
            model_type="deepseek_v3",
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            first_k_dense_replace=1,
        )
    )
    names = {n for p in stage_plans(config, Ownership.full(config)) for n in p.sources()}
    shapes = {n: (4, 8) for n in names}
    model = ModelSpec.from_checkpoint_shapes(config, "tiny-v3", shapes, 2)
    assert model.kv_bytes_per_token_per_layer == (16 + 4) * 2
    assert model.layer_active_bytes[0] == model.layer_bytes[0]  # dense layer: all read
    assert model.layer_active_bytes[1] < model.layer_bytes[1]  # 2 of 8 experts read
    del shapes["model.layers.2.mlp.gate.weight"]
    with pytest.raises(Exception, match="model.layers.2.mlp.gate.weight"):
        ModelSpec.from_checkpoint_shapes(config, "tiny-v3", shapes, 2)


def test_plan_command_writes_then_checks_a_lock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pool = [
        {
            "node_id": x,
            "free_memory_gb": 0.36,
            "bytes_per_second": 2e10,
            "latency_ms": 0.25,
            "bandwidth_mbps": 1000,
        }
        for x in "ab"
    ]
    nodes_file, lock = tmp_path / "nodes.json", tmp_path / "plan.lock.json"
    nodes_file.write_text(json.dumps(pool))
    assert run_plan_command(str(nodes_file), None, str(lock), 2048, 1) == 0
    out = capsys.readouterr().out
    assert "ms/token" in out and "[0," in out and lock.exists()
    pinned = Plan.from_json(lock.read_text())
    assert pinned.node_ids() == ("a", "b")
    assert run_plan_command(str(nodes_file), None, str(lock), 2048, 1) == 0
    assert "locked plan" in capsys.readouterr().out
    nodes_file.write_text(json.dumps(pool[:1] + [dict(pool[1], node_id="c")]))
    with pytest.raises(PlanError, match="not in the pool"):
        run_plan_command(str(nodes_file), None, str(lock), 2048, 1)
    from seamline.net.link import free_port

    with pytest.raises(PlanError, match="cannot read the live mesh"):  # nothing listens there
        run_plan_command(None, None, None, 2048, 1, live_url=f"http://127.0.0.1:{free_port()}")


def test_nodes_file_is_checked_strictly() -> None:
    nodes, links = parse_pool(
        {
            "nodes": [{"node_id": "a", "free_memory_bytes": 10, "bytes_per_second": 1.0}],
            "links": [{"a": "a", "b": "z", "latency_ms": 2, "bandwidth_mbps": 8}],
        }
    )
    assert nodes[0].free_memory_bytes == 10 and links.between("z", "a") == LinkCost(0.002, 1e6)
    with pytest.raises(PlanError, match="unknown field 'ram'"):
        parse_pool([{"node_id": "a", "ram": 1, "bytes_per_second": 1.0}])
    with pytest.raises(PlanError, match="exactly one of free_memory_gb"):
        parse_pool([{"node_id": "a", "bytes_per_second": 1.0}])
    with pytest.raises(PlanError, match="bytes_per_second"):
        parse_pool([{"node_id": "a", "free_memory_gb": 1, "bytes_per_second": "fast"}])
    with pytest.raises(PlanError, match="non-empty JSON list"):
        parse_pool([])


def test_a_quantized_model_plans_at_its_quantized_size() -> None:
    """The embedded Q4_1 model counts its GGUF block bytes, not float32: a node with a quarter
    of the float32 size plans it alone (its Q4 size fits), and with float32 sizes it would not."""
    from seamline.app import default_model_path
    from seamline.mesh.control.plan_cli import model_spec
    from seamline.weights.gguf import GGUFSource

    source = GGUFSource(default_model_path())
    quantized, config = model_spec(str(default_model_path()), 4)
    gguf_bytes = sum(info.nbytes for info in source.file.tensors.values())
    assert (
        quantized.weight_bytes() <= gguf_bytes
    )  # blocks as stored (norms at 4 bytes, as in the file)
    assert quantized.weight_bytes() >= 0.98 * gguf_bytes
    shapes = {n: source.shape(n) for n in source.names()}
    as_float32 = ModelSpec.from_checkpoint_shapes(config, "f32", shapes, 4)
    assert as_float32.weight_bytes() > 5 * quantized.weight_bytes()
    options = PlanOptions(context_tokens=256, headroom_fraction=0.0, headroom_bytes=0)
    free = as_float32.weight_bytes() // 4
    assert (
        plan(quantized, [node("a", free)], LinkTable(), options).stages[0].end == config.num_layers
    )
    with pytest.raises(PlanError):
        plan(as_float32, [node("a", free)], LinkTable(), options)


def test_like_nodes_measured_within_noise_plan_alike() -> None:
    """Rates within 15% of their group's slowest become the group's mean; others stay, and the
    embedded model on two like nodes measured up to 13% apart splits as on two equal nodes."""
    from seamline.mesh.plan.measured import steady_rates

    nodes = [
        NodeInfo("a", 1 << 30, 20e9),
        NodeInfo("b", 1 << 30, 22.6e9),
        NodeInfo("c", 1 << 30, 40e9),
    ]
    steadied = {n.node_id: n.bytes_per_second for n in steady_rates(nodes)}
    assert steadied == {"a": 21.3e9, "b": 21.3e9, "c": 40e9}
    assert [n.bytes_per_second for n in steady_rates(nodes[:1])] == [20e9]
    model = _embedded_spec()
    for measured in (5.4e9, 5.65e9):  # raw, these plan 16 + 14 and 18 + 12
        like = [node("a", 1 << 32, 5e9), node("b", 1 << 32, measured)]
        p = plan(model, steady_rates(like), None, PlanOptions(context_tokens=2048))
        assert [s.end - s.start for s in p.stages] == [17, 13], measured
