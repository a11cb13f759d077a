"""Fragments: package a checkpoint, load a range from its fragments only (serving and fetching
them: tests/mesh/test_fragment_fetch.py).

A tiny random Llama folder drives the fast tests; the embedded GGUF is packaged once per
module (~540 MB of float32 fragments) for the real-weights equivalence and tokenizer checks.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from seamline.app import default_model_path
from seamline.errors import CheckpointError
from seamline.ownership import Ownership
from seamline.text import TextCodec
from seamline.weights.fragments import (
    FragmentSource,
    Manifest,
    file_sha256,
    fragments_for,
)
from seamline.weights.loader import load_stage, open_source
from seamline.weights.packaging import package, package_cached
from tests.support.fragments import LAYERS, build_tiny, fragment_range, subset
from tests.support.reference import random_ids


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_package(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    out = tmp_path_factory.mktemp("tiny_package")
    return out, package(tiny, out, progress=False)


@pytest.fixture(scope="module")
def gguf_package(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Manifest]]:
    out = tmp_path_factory.mktemp("gguf_package")
    yield out, package(default_model_path(), out, progress=False)
    shutil.rmtree(out, ignore_errors=True)


# ---------------------------------------------------------------- packaging


@pytest.mark.parametrize("which", ["tiny_package", "gguf_package"])
def test_manifest_matches_files(which: str, request: pytest.FixtureRequest) -> None:
    folder, manifest = request.getfixturevalue(which)
    assert Manifest.load(folder) == manifest
    for entry in manifest.fragments:
        path = folder / entry.file
        assert path.stat().st_size == entry.bytes and file_sha256(path) == entry.sha256
    names = [f.name for f in manifest.fragments if f.kind != "tokenizer"]
    layers = [f"layer.{i}" for i in range(manifest.num_layers)]
    assert names == ["embed", *layers, "head"]
    assert {f.name for f in manifest.fragments if f.kind == "tokenizer"} >= {
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_fragment_source_names_equal_checkpoint(
    tiny: Path, tiny_package: tuple[Path, Manifest]
) -> None:
    folder, manifest = tiny_package
    source = FragmentSource(folder, manifest)
    assert source.names() == open_source(tiny).names()
    assert all(t.dtype == "float32" for f in manifest.fragments for t in f.tensors)
    assert source.config_dict() == json.loads((tiny / "config.json").read_text())


def test_hf_dtype_is_kept(tiny: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bf16"
    shutil.copytree(tiny, folder)
    weights = load_file(folder / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, folder / "model.safetensors")
    manifest = package(folder, tmp_path / "package", progress=False)
    assert {t.dtype for f in manifest.fragments for t in f.tensors} == {"bfloat16"}
    source = FragmentSource(tmp_path / "package")
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(source.get(name), weights[name].to(torch.bfloat16))


def test_tampered_manifest_is_refused(tiny_package: tuple[Path, Manifest], tmp_path: Path) -> None:
    folder, manifest = tiny_package
    data = manifest.to_json()
    data["fragments"][1]["sha256"] = "0" * 64
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="model_hash .* does not match"):
        Manifest.load(tmp_path)


def test_gguf_fragments_keep_the_quantized_blocks(gguf_package: tuple[Path, Manifest]) -> None:
    """Each quantized tensor is stored as its GGUF bytes unchanged, with its quant type and
    logical shape in the manifest: a fragment's bytes are the GGUF tensor bytes it holds
    (plus the safetensors header), and the model hash covers the tensor entries."""
    from seamline.quant.tensor import QuantTensor
    from seamline.weights.gguf import GGUFSource

    folder, manifest = gguf_package
    gguf, fragments = GGUFSource(default_model_path()), FragmentSource(folder, manifest)
    layer = manifest.fragment("layer.3")
    assert {t.dtype for t in layer.tensors} == {"Q4_1", "float32"}
    for entry in layer.tensors:
        ours, theirs = fragments.get(entry.name), gguf.get(entry.name)
        if isinstance(theirs, QuantTensor):
            assert isinstance(ours, QuantTensor) and ours.qtype == theirs.qtype
            assert ours.shape == theirs.shape == entry.shape
            assert torch.equal(ours.data, theirs.data), entry.name
    names = {
        f"blk.3.{k}.weight"
        for k in (
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
            "attn_norm",
            "ffn_norm",
        )
    }
    held = sum(gguf.file.tensors[n].nbytes for n in names)
    assert held <= layer.bytes <= held + 4096  # the safetensors header: a few hundred bytes
    total = sum(info.nbytes for info in gguf.file.tensors.values())
    stored = sum(f.bytes for f in manifest.fragments if f.kind != "tokenizer")
    assert total <= stored <= total + 4096 * len(manifest.fragments)
    data = manifest.to_json()
    data["fragments"][3]["tensors"][0]["dtype"] = "Q8_0"  # the quant type is covered by the hash
    with pytest.raises(CheckpointError, match="model_hash"):
        Manifest.from_json(data)


def test_gguf_tied_head_needs_embed(gguf_package: tuple[Path, Manifest]) -> None:
    _, manifest = gguf_package
    assert manifest.tie_word_embeddings
    assert [t.name for t in manifest.fragment("head").tensors] == ["model.norm.weight"]
    last = {f.name for f in fragment_range(manifest, 28, 30)}
    assert last == {
        "embed",
        "layer.28",
        "layer.29",
        "head",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    assert {f.name for f in fragment_range(manifest, 10, 12)} == {"layer.10", "layer.11"}


def test_gguf_package_tokenizer_equals_gguf(gguf_package: tuple[Path, Manifest]) -> None:
    folder, manifest = gguf_package
    ours, theirs = TextCodec.from_model(folder), TextCodec.from_model(default_model_path())
    chat = [{"role": "user", "content": "What is the capital of France? 1234 ünïcode"}]
    assert ours.encode_chat(chat) == theirs.encode_chat(chat)
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    assert set(theirs.stop_ids) <= set(ours.stop_ids)


# ---------------------------------------------------------------- loading a range


def _stage_outputs(stage: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    cache = stage.new_cache()  # type: ignore[operator]
    return torch.cat([stage(inputs[:8], 0, cache), stage(inputs[8:9], 8, cache)])


@pytest.mark.parametrize("which,path", [("tiny_package", "tiny"), ("gguf_package", "gguf")])
def test_range_from_fragments_equals_checkpoint(
    which: str, path: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    folder, manifest = request.getfixturevalue(which)
    model = request.getfixturevalue("tiny") if path == "tiny" else default_model_path()
    original = open_source(model)
    layers = manifest.num_layers
    for start, end in ((0, 2), (layers - 2, layers)):
        node = subset(folder, manifest, fragment_range(manifest, start, end), tmp_path / f"{start}")
        own = Ownership(layers=(start, end))
        ours, theirs = load_stage(FragmentSource(node), own), load_stage(original, own)
        if start == 0:
            inputs = random_ids(ours.config.vocab_size, 9)
        else:
            inputs = torch.randn(
                9, ours.config.hidden_size, generator=torch.Generator().manual_seed(0)
            )
        assert torch.equal(_stage_outputs(ours, inputs), _stage_outputs(theirs, inputs))


def test_absent_fragment_is_named(tiny_package: tuple[Path, Manifest], tmp_path: Path) -> None:
    folder, manifest = tiny_package
    node = subset(folder, manifest, fragment_range(manifest, 2, LAYERS), tmp_path / "node")
    load_stage(FragmentSource(node), Ownership(layers=(2, LAYERS)))  # its own range loads
    with pytest.raises(
        CheckpointError,
        match=r"fragment embed \(holding model.embed_tokens.weight\) is not present on this node",
    ):
        load_stage(FragmentSource(node), Ownership(layers=(0, 2)))
    with pytest.raises(CheckpointError, match=r"fragment layer.1 .* is not present"):
        load_stage(FragmentSource(node), Ownership(layers=(1, LAYERS)))


def test_package_cached_reuses(tiny: Path, tmp_path: Path) -> None:
    first = package_cached(tiny, tmp_path, progress=False)
    stamps = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    time.sleep(0.01)
    second = package_cached(tiny, tmp_path, progress=False)
    assert second == first
    assert {p.name: p.stat().st_mtime_ns for p in second.iterdir()} == stamps
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial folder left


# ---------------------------------------------------------------- routed experts apart


def test_a_lockstep_rank_fetches_only_its_routed_experts(tmp_path: Path) -> None:
    """An MoE layer's routed experts are packaged in chunks beside the layer's other tensors; a
    rank's fragments hold its experts and no other's, and its shard loads from them alone,
    equal to the same shard read from the checkpoint."""
    from seamline.config import ModelConfig
    from seamline.ownership import rank_ownership
    from tests.support.deepseek import build_deepseek

    _, built = build_deepseek(tmp_path / "m", "v3")  # 8 routed experts, layers 1 and 2 MoE
    manifest = package(built, tmp_path / "pkg", progress=False)
    config = ModelConfig.from_hf_dict(manifest.config)
    chunks = [f for f in manifest.fragments if f.kind == "experts"]
    assert {(f.layer, f.experts) for f in chunks} == {
        (i, (e, e + 1)) for i in config.moe_layers for e in range(8)
    }
    assert all(
        ".experts." not in t.name
        for i in config.moe_layers
        for t in manifest.fragment(f"layer.{i}").tensors
    )
    assert Manifest.from_json(json.loads(json.dumps(manifest.to_json()))) == manifest
    everything = (0, config.num_layers)
    for world in (2, 4):
        for rank in range(world):
            own = rank_ownership(config, rank, world)
            entries = fragments_for(manifest, everything, True, True, own.experts)
            assert {f.experts for f in entries if f.kind == "experts"} == {
                (e, e + 1) for e in range(*own.experts)
            }
            folder = subset(tmp_path / "pkg", manifest, entries, tmp_path / f"rank{rank}of{world}")
            from_fragments = load_stage(FragmentSource(folder), own).state_dict()
            from_checkpoint = load_stage(open_source(built), own).state_dict()
            assert from_fragments.keys() == from_checkpoint.keys()
            assert all(torch.equal(from_fragments[k], from_checkpoint[k]) for k in from_checkpoint)
    assert len(fragments_for(manifest, everything, True, True)) == len(
        manifest.fragments
    )  # a whole stage: all
