"""The planner forming lockstep groups: N nodes share a stage when no single node holds one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from seamline.config import ModelConfig
from seamline.errors import ConfigError
from seamline.mesh.plan.groups import (
    check_world,
    group_sizes,
    group_spec,
    plan_auto,
    plan_groups,
)
from seamline.mesh.plan.planner import check_plan
from seamline.mesh.plan.types import ModelSpec, NodeInfo, Plan, PlanError, PlanOptions
from seamline.ownership import Ownership
from seamline.weights.names import stage_plans

MIB = 1 << 20
EXACT = PlanOptions(
    context_tokens=1024, batch=1, headroom_fraction=0.0, headroom_bytes=0, objective="latency"
)
# 4 layers of 400 MiB: the model holds 1600 MiB of layers + 100 MiB embedding + 100 MiB head.
SPEC = ModelSpec("m", 4, 1024, (400 * MIB,) * 4, 100 * MIB, 100 * MIB, 0, 4096)


def _config(experts: int = 8, heads: int = 8, kv_heads: int = 4) -> ModelConfig:
    return ModelConfig.from_hf_dict(
        {
            "model_type": "mixtral",
            "vocab_size": 1000,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "num_local_experts": experts,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,
        }
    )


def _nodes(count: int, free_mib: int) -> list[NodeInfo]:
    return [NodeInfo(f"n{i}", free_mib * MIB, 1e10) for i in range(count)]


def test_one_node_per_stage_when_that_fits() -> None:
    found = plan_auto(SPEC, _nodes(2, 1000), None, EXACT, _config())
    assert [s.ranks for s in found.stages] == [(), ()]


def test_a_group_forms_when_no_single_node_holds_a_layer_range() -> None:
    # 8 nodes of 350 MiB: no node holds even one 400 MiB layer, so no stage split fits; a rank
    # of a pair holds 200 MiB per layer (two layers would be 400): four stages of 2 ranks.
    nodes = _nodes(8, 350)
    with pytest.raises(PlanError):
        plan_auto(SPEC, nodes, None, EXACT, _config(), world=1)
    found = plan_auto(SPEC, nodes, None, EXACT, _config())
    assert [len(s.ranks) for s in found.stages] == [2, 2, 2, 2]
    assert sorted(m for s in found.stages for m in s.members()) == [f"n{i}" for i in range(8)]
    # per rank: half a layer, plus the whole embedding (replicated) or half the head
    assert found.stages[0].weight_bytes == 200 * MIB + 100 * MIB
    assert found.stages[-1].weight_bytes == 200 * MIB + 50 * MIB


def test_fixed_group_size_and_its_refusals() -> None:
    found = plan_auto(SPEC, _nodes(2, 2000), None, EXACT, _config(), world=2)
    assert len(found.stages) == 1 and found.stages[0].members() == ("n0", "n1")
    with pytest.raises(PlanError, match="groups of 2 need at least 2 nodes"):
        plan_groups(SPEC, _nodes(1, 5000), None, EXACT, 2, True)
    with pytest.raises(ConfigError, match="8 routed experts do not divide among 3"):
        check_world(_config(), 3)
    assert group_sizes(_config(experts=8, heads=8, kv_heads=4)) == (1, 2, 4, 8)
    assert group_sizes(_config(experts=6, heads=6, kv_heads=2)) == (1, 2, 3, 6)


def test_a_group_plan_round_trips_and_a_lock_needs_every_member() -> None:
    found = plan_auto(SPEC, _nodes(8, 350), None, EXACT, _config())
    again = Plan.from_json(found.to_json())
    assert again == found
    check_plan(again, SPEC, _nodes(8, 350), EXACT)
    with pytest.raises(PlanError, match="needs node 'n7'"):
        check_plan(again, SPEC, _nodes(7, 350), EXACT)


def test_plan_command_prints_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from seamline.mesh.control.plan_cli import run_plan_command

    pool = [{"node_id": name, "free_memory_gb": 4, "bytes_per_second": 1e10} for name in "abcd"]
    (tmp_path / "pool.json").write_text(json.dumps(pool))
    lock = tmp_path / "lock.json"
    assert (
        run_plan_command(str(tmp_path / "pool.json"), None, str(lock), 1024, 1, tensor_parallel=2)
        == 0
    )
    printed = capsys.readouterr().out
    assert "a+b" in printed and "lockstep group" in printed, printed
    assert "optimised for throughput" in printed, printed
    # either group could hold the model: for throughput both take a share, as two stages
    assert [list(s["ranks"]) for s in json.loads(lock.read_text())["stages"]] == [
        ["a", "b"],
        ["c", "d"],
    ]
    assert (
        run_plan_command(str(tmp_path / "pool.json"), None, str(lock), 1024, 1) == 0
    )  # the lock, checked
    assert "a+b" in capsys.readouterr().out
    fresh = tmp_path / "latency.json"
    assert (
        run_plan_command(
            str(tmp_path / "pool.json"),
            None,
            str(fresh),
            1024,
            1,
            tensor_parallel=2,
            objective="latency",
        )
        == 0
    )
    assert "optimised for per-token latency" in capsys.readouterr().out
    assert [list(s["ranks"]) for s in json.loads(fresh.read_text())["stages"]] == [
        ["a", "b"]
    ]  # no hop


def test_a_ranks_planned_bytes_are_what_it_loads(tmp_path: Path) -> None:
    """A DeepSeek-V3 rank holds 1/N of experts, heads and rows, but its router, shared expert,
    MLA down-projections and norms whole: the planner's per-rank layer bytes are exactly the
    bytes of the layer parameters each rank loads."""
    from seamline.mesh.plan.groups import group_spec
    from seamline.ownership import rank_ownership
    from seamline.weights.loader import load_stage, open_source
    from tests.support.deepseek import build_deepseek

    _, built = build_deepseek(tmp_path / "m", "v3")
    source = open_source(built)
    config = ModelConfig.from_hf_dict(source.config_dict())
    spec = ModelSpec.from_checkpoint_shapes(
        config, "v3", {n: source.shape(n) for n in source.names()}, 4
    )
    assert any(spec.layer_replicated_bytes)
    for world in (2, 4):
        planned = group_spec(spec, world, kv_split=False).layer_bytes
        for rank in range(world):
            stage = load_stage(source, rank_ownership(config, rank, world))
            held = [
                sum(
                    p.numel() * 4
                    for name, p in stage.named_parameters()
                    if name.startswith(f"layers.{i}.")
                )
                for i in range(config.num_layers)
            ]
            assert held == list(planned), (world, rank)


def test_a_group_rank_counts_the_quant_blocks_around_its_cut_columns() -> None:
    """An attention output split by heads across 256-wide Q4_K blocks: each rank may keep up to
    two blocks a row beyond its share (ColumnWindow); the per-rank bytes include them."""
    config = ModelConfig.from_hf_dict(
        dict(
            model_type="llama",
            vocab_size=256,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
        )
    )
    names = {n for p in stage_plans(config, Ownership.full(config)) for n in p.sources()}
    shapes = {
        n: (
            (256, 256)
            if "o_proj" in n or "q_proj" in n or "k_proj" in n or "v_proj" in n
            else (512, 256)
            if "gate" in n or "up_proj" in n
            else (256, 512)
            if "down" in n
            else (256, 256)
            if "embed" in n
            else (256,)
        )
        for n in names
    }
    quantized = {n: "Q4_K" for n in names if len(shapes[n]) == 2}
    spec = ModelSpec.from_checkpoint_shapes(config, "q", shapes, 4, quantized)
    plain = ModelSpec.from_checkpoint_shapes(config, "f", shapes, 4)
    assert (
        spec.layer_window_bytes[0] == 2 * 256 * 144 * 2
    )  # o_proj and down_proj: 256 rows, 2 blocks each
    assert plain.layer_window_bytes[0] == 0  # float weights are cut anywhere
    per_rank = group_spec(spec, 2, True)
    assert (
        per_rank.layer_bytes[0]
        - group_spec(replace(spec, layer_window_bytes=()), 2, True).layer_bytes[0]
        == spec.layer_window_bytes[0]
    )
