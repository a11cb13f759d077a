"""The planner counts the multi-token-prediction layer on the last stage where it drafts with it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from seamline.mesh.control.startup import route_speculation
from seamline.mesh.plan.groups import group_spec
from seamline.mesh.plan.planner import plan, price_route
from seamline.mesh.plan.types import ModelSpec, PlanError
from seamline.ownership import Ownership
from tests.support.planner import EXACT, MIB, node, spec

# 4 layers of 100 MiB, 10 MiB embedding and head; a 100 MiB drafting layer that reads a 10 MiB embedding
DRAFTS = replace(
    spec(4, embed=10 * MIB, head=10 * MIB), mtp_bytes=100 * MIB, mtp_embed_bytes=10 * MIB
)


def test_the_last_stage_holds_the_drafting_layer_and_an_embedding_unless_it_owns_the_models() -> (
    None
):
    plain = replace(DRAFTS, mtp_bytes=0, mtp_embed_bytes=0)
    nodes = [node("a", 1 << 40), node("b", 1 << 40)]
    split, alone = [("a", 0, 2), ("b", 2, 4)], [("a", 0, 4)]
    for route, extra in ((split, 110 * MIB), (alone, 100 * MIB)):
        planned = price_route(DRAFTS, nodes, None, EXACT, route).stages
        without = price_route(plain, nodes, None, EXACT, route).stages
        assert planned[-1].weight_bytes == without[-1].weight_bytes + extra
        assert [s.weight_bytes for s in planned[:-1]] == [s.weight_bytes for s in without[:-1]]
    assert DRAFTS.weight_bytes() == plain.weight_bytes() + 100 * MIB


def test_a_node_that_holds_the_last_layers_but_not_the_drafting_layer_is_not_their_stage() -> None:
    """Two nodes of 250 MiB hold 2 layers each with the embedding or the head; with the drafting
    layer the last stage needs 320 MiB: the planner refuses what it would have split."""
    nodes = [node("a", 250 * MIB), node("b", 250 * MIB)]
    plain = replace(DRAFTS, mtp_bytes=0, mtp_embed_bytes=0)
    assert plan(plain, nodes, None, EXACT).ranges() == ((0, 2), (2, 4))
    with pytest.raises(PlanError):
        plan(DRAFTS, nodes, None, EXACT)
    wide = [node("a", 250 * MIB), node("b", 250 * MIB), node("c", 250 * MIB)]
    found = plan(DRAFTS, wide, None, EXACT)
    last = found.stages[-1]
    assert (last.start, last.end) == (
        3,
        4,
    ) and last.weight_bytes == 100 * MIB + 10 * MIB + 110 * MIB
    assert all(s.predicted_bytes <= EXACT.capacity(250 * MIB) for s in found.stages)


def test_a_lockstep_groups_last_stage_and_checked_or_private_routes_draft_no_mtp() -> None:
    assert group_spec(DRAFTS, 2, kv_split=True).mtp_held(1) == 0
    assert route_speculation("mtp", False, 0.0, last_ranks=2) == "ngram"
    assert (
        route_speculation("mtp", True, 0.0) == "off"
        and route_speculation("mtp", False, 0.1) == "off"
    )
    assert route_speculation("mtp", False, 0.0) == "mtp"


def test_serve_plans_the_drafting_layer_as_its_fragments_and_as_the_last_stage_loads_it(
    tmp_path: Path,
) -> None:
    """DeepSeek-V3 with its MTP layer: ``serve`` (which drafts with it by default) plans the
    bytes of the package's fragments of layer N (the layer and its own copy of the embedding),
    as ``seamline plan`` does, and with ``--speculative off`` none; the planned last stage holds
    exactly the parameters a last stage that drafts loads."""
    from seamline.app import default_model_path
    from seamline.mesh.control.plan_cli import model_spec
    from seamline.mesh.control.serve import ServeOptions, build_mesh
    from seamline.quant.sizes import resident_bytes
    from seamline.runtime.speculation import Speculation
    from seamline.weights.fragments import Manifest
    from seamline.weights.gguf import tokenizer_from_gguf
    from seamline.weights.loader import load_stage, open_source
    from tests.support.deepseek import add_mtp_layer, build_deepseek
    from tests.support.v4_reference import with_tokenizer

    # the embedded tokenizer and its vocabulary: serve reads the tokenizer before it plans
    vocab = tokenizer_from_gguf(default_model_path()).get_vocab_size()
    model, folder = build_deepseek(tmp_path / "m", "v3", vocab_size=vocab)
    add_mtp_layer(model, folder)
    with_tokenizer(folder)
    specs: dict[str, ModelSpec] = {}
    for mode in ("auto", "off"):
        mesh = build_mesh(
            ServeOptions(
                model=str(folder),
                cache_dir=tmp_path / "cache",
                precision="exact",
                speculation=Speculation(mode),
                local_node=False,
            )
        )
        specs[mode] = mesh.coordinator.model
        mesh.coordinator.shut_down()
    manifest = Manifest.load(mesh.package_dir)
    layer_n = [t for f in manifest.fragments if f.layer == manifest.num_layers for t in f.tensors]
    assert (
        specs["auto"].mtp_held(1) == sum(resident_bytes(t.shape, t.dtype, 4) for t in layer_n) > 0
    )
    assert specs["off"].mtp_held(1) == 0
    assert model_spec(str(folder), 4)[0].mtp_held(1) == specs["auto"].mtp_held(
        1
    )  # `seamline plan`, as serve
    L = manifest.num_layers
    last = price_route(
        specs["auto"],
        [node("a", 1 << 40), node("b", 1 << 40)],
        None,
        EXACT,
        [("a", 0, L // 2), ("b", L // 2, L)],
    ).stages[-1]
    stage = load_stage(open_source(folder), Ownership(layers=(L // 2, L)), mtp=True)
    assert last.weight_bytes == sum(p.numel() * 4 for p in stage.parameters())
