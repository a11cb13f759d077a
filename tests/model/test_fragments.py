"""Fragments: package, load a range from its fragments only, serve and fetch with resume/cache.

A tiny random Llama folder drives the fast tests; the embedded GGUF is packaged once per
module (~540 MB of float32 fragments) for the real-weights equivalence and tokenizer checks.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from seamline.app import default_model_path
from seamline.errors import CheckpointError
from seamline.mesh.node.fetch import (
    FetchError,
    fetch_fragments,
    fetch_manifest,
    materialise,
)
from seamline.ownership import Ownership
from seamline.text import TextCodec
from seamline.weights.fragments import (
    FragmentEntry,
    FragmentSource,
    Manifest,
    file_sha256,
    fragments_for,
)
from seamline.weights.loader import load_stage, open_source
from seamline.weights.packaging import package, package_cached
from tests.support.reference import random_ids, save_random_model
from tests.support.small_disk import small_file_system

TOKEN = "s3cret"
LAYERS = 4
SMALL: dict[str, Any] = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip


def _tokenizer_files(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(SMALL["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
              "bos_token": "w1", "eos_token": "w2"}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("tiny")
    save_random_model(LlamaConfig(**SMALL, tie_word_embeddings=False), folder)
    _tokenizer_files(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_package(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    out = tmp_path_factory.mktemp("tiny_package")
    return out, package(tiny, out, progress=False)


@pytest.fixture(scope="module")
def gguf_package(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Manifest]]:
    out = tmp_path_factory.mktemp("gguf_package")
    yield out, package(default_model_path(), out, progress=False)
    shutil.rmtree(out, ignore_errors=True)


def _subset(package_dir: Path, manifest: Manifest, entries: list[FragmentEntry], dest: Path) -> Path:
    """A node's folder: the manifest plus only these fragment files."""
    dest.mkdir()
    for entry in entries:
        shutil.copyfile(package_dir / entry.file, dest / entry.file)
    manifest.save(dest)
    return dest


def _range(manifest: Manifest, start: int, end: int) -> list[FragmentEntry]:
    return fragments_for(manifest, (start, end), start == 0, end == manifest.num_layers)


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
    assert {f.name for f in manifest.fragments if f.kind == "tokenizer"} >= {"tokenizer.json", "tokenizer_config.json"}


def test_fragment_source_names_equal_checkpoint(tiny: Path, tiny_package: tuple[Path, Manifest]) -> None:
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
    names = {f"blk.3.{k}.weight" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                          "ffn_up", "ffn_down", "attn_norm", "ffn_norm")}  # fmt: skip
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
    last = {f.name for f in _range(manifest, 28, 30)}
    assert last == {"embed", "layer.28", "layer.29", "head", "tokenizer.json",
                    "tokenizer_config.json", "generation_config.json"}  # fmt: skip
    assert {f.name for f in _range(manifest, 10, 12)} == {"layer.10", "layer.11"}


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
        node = _subset(folder, manifest, _range(manifest, start, end), tmp_path / f"{start}")
        own = Ownership(layers=(start, end))
        ours, theirs = load_stage(FragmentSource(node), own), load_stage(original, own)
        if start == 0:
            inputs = random_ids(ours.config.vocab_size, 9)
        else:
            inputs = torch.randn(9, ours.config.hidden_size, generator=torch.Generator().manual_seed(0))
        assert torch.equal(_stage_outputs(ours, inputs), _stage_outputs(theirs, inputs))


def test_absent_fragment_is_named(tiny_package: tuple[Path, Manifest], tmp_path: Path) -> None:
    folder, manifest = tiny_package
    node = _subset(folder, manifest, _range(manifest, 2, LAYERS), tmp_path / "node")
    load_stage(FragmentSource(node), Ownership(layers=(2, LAYERS)))  # its own range loads
    with pytest.raises(CheckpointError, match=r"fragment embed \(holding model.embed_tokens.weight\) is not present on this node"):
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


# ---------------------------------------------------------------- serving and fetching


def _free_port() -> int:
    for port in random.sample(range(20000, 30000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 20000-30000")


@contextmanager
def _serve(app: Any, log_level: str = "warning") -> Iterator[str]:
    """Run ``app`` with a real uvicorn server on 127.0.0.1 in a thread; yield its base URL."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture()
def served(tiny_package: tuple[Path, Manifest], tmp_path: Path) -> Iterator[tuple[str, Path, Manifest]]:
    """A copy of the tiny package (so a test may tamper with it), served by real uvicorn."""
    from fastapi import FastAPI

    from seamline.mesh.protocol.fragment_server import fragment_routes

    folder = tmp_path / "served"
    shutil.copytree(tiny_package[0], folder)
    app = FastAPI()
    fragment_routes(app, folder, lambda token: token == TOKEN)
    with _serve(app) as url:
        yield url, folder, tiny_package[1]


def _plain_server(data: bytes, cut: int | None = None) -> Any:
    """A server without Range support; with ``cut`` it promises all of ``data`` and breaks off."""
    from fastapi import FastAPI, Response
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/fragments/{sha256}")
    def whole(sha256: str) -> Response:
        if cut is None:
            return Response(data, media_type="application/octet-stream")
        headers = {"content-length": str(len(data))}
        return StreamingResponse(iter([data[:cut]]), headers=headers)

    return app


def test_broken_download_resumes_and_whole_answer_restarts(
    served: tuple[str, Path, Manifest], tmp_path: Path
) -> None:
    url, folder, manifest = served
    entry = manifest.fragment("layer.0")
    data, cache = (folder / entry.file).read_bytes(), tmp_path / "cache"
    part = cache / f"{entry.sha256}.part"
    with _serve(_plain_server(data, cut=entry.bytes // 2), "critical") as broken:
        with pytest.raises(FetchError, match="broke off .* run again to resume"):
            fetch_fragments(broken, [entry], cache, progress=False)
    assert part.stat().st_size == entry.bytes // 2
    with _serve(_plain_server(data)) as whole:  # answers a Range request with 200: restart
        assert fetch_fragments(whole, [entry], cache, progress=False).bytes_downloaded == entry.bytes
    (cache / entry.sha256).rename(part)  # complete but unverified: verified without a request
    report = fetch_fragments(url, [entry], cache, TOKEN, progress=False)
    assert report.bytes_downloaded == 0 and file_sha256(cache / entry.sha256) == entry.sha256


def test_fetch_range_then_cache(served: tuple[str, Path, Manifest], tmp_path: Path) -> None:
    url, _, manifest = served
    assert fetch_manifest(url, TOKEN) == manifest
    entries = _range(manifest, 2, LAYERS)
    cache = tmp_path / "cache"
    followed: list[tuple[int, int]] = []  # what a node reports to the coordinator as it downloads
    report = fetch_fragments(url, entries, cache, TOKEN, progress=False, on_progress=lambda *p: followed.append(p))
    total = sum(e.bytes for e in entries)
    assert report.bytes_downloaded == total
    assert (report.fragments_downloaded, report.fragments_from_cache) == (len(entries), 0)
    assert followed[-1] == (total, total) and {t for _, t in followed} == {total}
    assert [d for d, _ in followed] == sorted(d for d, _ in followed) and len(followed) >= len(entries)
    again = fetch_fragments(url, entries, cache, TOKEN, progress=False)
    assert (again.bytes_downloaded, again.fragments_downloaded) == (0, 0)
    assert again.fragments_from_cache == len(entries)
    node = materialise(manifest, entries, cache, tmp_path / "node")
    stage = load_stage(FragmentSource(node), Ownership(layers=(2, LAYERS)))
    assert stage.head is not None and TextCodec.from_model(node).encode("w5 w6") == [5, 6]


def test_interrupted_fetch_resumes(served: tuple[str, Path, Manifest], tmp_path: Path) -> None:
    url, folder, manifest = served
    entry = manifest.fragment("layer.1")
    cache = tmp_path / "cache"
    cache.mkdir()
    kept = entry.bytes // 3
    (cache / f"{entry.sha256}.part").write_bytes((folder / entry.file).read_bytes()[:kept])
    report = fetch_fragments(url, [entry], cache, TOKEN, progress=True)
    assert report.bytes_downloaded == entry.bytes - kept
    assert file_sha256(cache / entry.sha256) == entry.sha256
    assert not (cache / f"{entry.sha256}.part").exists()


def test_corrupt_fragment_is_refused(
    served: tuple[str, Path, Manifest], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, folder, manifest = served
    entry = manifest.fragment("layer.3")
    data = bytearray((folder / entry.file).read_bytes())
    data[-1] ^= 0xFF
    (folder / entry.file).write_bytes(bytes(data))
    cache = tmp_path / "cache"
    with caplog.at_level(logging.ERROR), pytest.raises(CheckpointError, match=f"fragment layer.3 hash mismatch: expected {entry.sha256}, got"):
        fetch_fragments(url, [entry], cache, TOKEN, progress=False)
    assert list(cache.iterdir()) == []
    assert "layer.3 hash mismatch" in caplog.text


def test_a_cached_fragment_changed_on_disk_is_hashed_and_fetched_again(
    served: tuple[str, Path, Manifest], tmp_path: Path
) -> None:
    """Two cached layers corrupted in place, their sizes kept: the next fetch finds that they
    changed since they were verified, hashes them, and downloads those two again. A file whose
    stamp still matches is trusted unread, so a corruption that also puts its modification
    time back is caught only by ``rehash``."""
    url, _, manifest = served
    entries = _range(manifest, 0, LAYERS)
    cache = tmp_path / "cache"
    fetch_fragments(url, entries, cache, TOKEN, progress=False)
    time.sleep(0.05)  # a later write: file times tick coarsely
    damaged = [manifest.fragment("layer.1"), manifest.fragment("layer.2")]
    for entry in damaged:
        _flip_a_byte(cache / entry.sha256)
    again = fetch_fragments(url, entries, cache, TOKEN, progress=False)
    assert (again.fragments_downloaded, again.bytes_downloaded) == (2, sum(e.bytes for e in damaged))
    assert all(file_sha256(cache / e.sha256) == e.sha256 for e in entries)
    hidden = cache / damaged[0].sha256
    times = hidden.stat().st_atime_ns, hidden.stat().st_mtime_ns
    _flip_a_byte(hidden)
    os.utime(hidden, ns=times)
    assert fetch_fragments(url, entries, cache, TOKEN, progress=False).fragments_downloaded == 0
    assert fetch_fragments(url, entries, cache, TOKEN, progress=False, rehash=True).fragments_downloaded == 1
    assert file_sha256(hidden) == damaged[0].sha256


def test_a_node_loading_its_stage_hashes_every_cached_fragment_and_fetches_a_damaged_one_again(
    served: tuple[str, Path, Manifest], tmp_path: Path
) -> None:
    """A node's load step reads every fragment anyway, so it hashes them all: a cached layer
    damaged in place with its size and modification time put back (its stamp still matches) is
    downloaded again, and the stage loads from intact files."""
    from seamline.mesh.node.loading import fetch_assignment
    from seamline.mesh.node.process import NodeOptions
    from seamline.net.messages import Assign

    url, _, manifest = served
    assign = Assign(plan_id=1, model_hash=manifest.model_hash, fragments_url=url, fragments_token=TOKEN,
                    layers=(0, LAYERS), owns_embedding=True, owns_head=True, dtype="float32", context_length=64)  # fmt: skip
    options = NodeOptions(node_id="n1", cache_dir=tmp_path / "node", progress=False)
    assert fetch_assignment(None, assign, options)[1].fragments_from_cache == 0  # type: ignore[arg-type]
    hidden = options.cache_dir / "fragments" / manifest.fragment("layer.2").sha256
    times = hidden.stat().st_atime_ns, hidden.stat().st_mtime_ns
    _flip_a_byte(hidden)
    os.utime(hidden, ns=times)
    _, report = fetch_assignment(None, assign, options)  # type: ignore[arg-type]
    assert (report.fragments_downloaded, report.bytes_downloaded) == (1, manifest.fragment("layer.2").bytes)
    assert file_sha256(hidden) == manifest.fragment("layer.2").sha256


def _flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB file system (tmpfs); skipped where this process may not mount one."""
    with small_file_system(tmp_path / "small") as folder:
        yield folder


def test_a_disk_without_room_is_refused_before_downloading(served: tuple[str, Path, Manifest], small_disk: Path) -> None:
    url, _, manifest = served
    stale = small_disk / f"{'f' * 64}.part"
    stale.write_bytes(b"x" * 1000)
    with pytest.raises(FetchError, match="GiB free, but this node's layers need .* GiB more: free some space"):
        fetch_fragments(url, _range(manifest, 0, LAYERS), small_disk, TOKEN, progress=False)
    assert not stale.exists()  # a partial download of another fragment was dropped to make room
    assert [p for p in small_disk.iterdir()] == []


def test_fragments_come_from_a_peer_that_serves_them_intact_else_from_the_coordinator(
    served: tuple[str, Path, Manifest], tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Peers are asked in order: one cannot be reached (not asked again), one answers garbage for
    everything (dropped: it fails the hash), one holds layers [0,2) only (those come from it,
    without the node's token); the rest come from the coordinator. Every fragment lands verified."""
    from fastapi import FastAPI

    from seamline.mesh.protocol.fragment_server import fragment_routes

    url, folder, manifest = served
    held = {e.sha256 for e in _range(manifest, 0, 2)}
    holder = tmp_path / "peer"
    shutil.copytree(folder, holder)
    for entry in manifest.fragments:
        if entry.sha256 not in held:
            (holder / entry.file).unlink()
    tokens: list[str | None] = []
    peer = FastAPI()
    fragment_routes(peer, holder, lambda token: tokens.append(token) is None)
    entries = _range(manifest, 0, LAYERS)
    with _serve(_plain_server(b"not this fragment")) as liar, _serve(peer) as holding:
        gone = f"http://127.0.0.1:{_free_port()}"
        caplog.set_level(logging.INFO, logger="seamline.mesh.node.fetch")
        report = fetch_fragments(url, entries, tmp_path / "cache", TOKEN, progress=False, peers=[gone, liar, holding])
    from_peer = sum(e.bytes for e in {e.sha256: e for e in entries}.values() if e.sha256 in held)
    assert 0 < report.bytes_from_peers == from_peer < report.bytes_downloaded
    assert tokens and set(tokens) == {None}  # the node's bearer token is for the coordinator alone
    for entry in entries:
        assert file_sha256(tmp_path / "cache" / entry.sha256) == entry.sha256
    assert not list((tmp_path / "cache").glob("*.part"))
    assert sum(f"peer {gone} cannot be reached" in r.getMessage() for r in caplog.records) == 1


def test_a_peer_serves_the_verified_fragments_it_holds_after_its_folder_changed(served: tuple[str, Path, Manifest],
                                                                                tmp_path: Path) -> None:  # fmt: skip
    """A node re-planned to other layers rewrites its stage folder while its peers load: it still
    serves what its cache holds verified (a file named by its hash, with its stamp), and nothing
    else there (no stamp, or a name that is no hash: 404)."""
    import httpx
    from fastapi import FastAPI

    from seamline.mesh.protocol.fragment_server import fragment_routes

    url, _, manifest = served
    held = tmp_path / "held"
    fetch_fragments(url, _range(manifest, 0, 2), held, TOKEN, progress=False)
    stage_folder = tmp_path / "stage"  # the new assignment's folder: no manifest yet
    stage_folder.mkdir()
    peer = FastAPI()
    fragment_routes(peer, stage_folder, lambda _token: True, held=held)
    entries = list({e.sha256: e for e in _range(manifest, 0, 2)}.values())
    unstamped = entries[-1].sha256
    (held / f"{unstamped}.verified").unlink()
    (held / "notes").write_text("not a fragment")
    with _serve(peer) as holding:
        report = fetch_fragments(url, entries[:-1], tmp_path / "cache", TOKEN, progress=False, peers=[holding])
        assert report.bytes_from_peers == sum(e.bytes for e in entries[:-1]) > 0
        assert httpx.get(f"{holding}/fragments/{unstamped}").status_code == 404
        assert httpx.get(f"{holding}/fragments/notes").status_code == 404
        assert httpx.get(f"{holding}/fragments/{'b' * 64}").status_code == 404


def test_bad_token_is_refused(served: tuple[str, Path, Manifest], tmp_path: Path) -> None:
    import httpx

    url, _, manifest = served
    entry = manifest.fragment("embed")
    assert httpx.get(f"{url}/fragments/{entry.sha256}").status_code == 401
    assert httpx.get(f"{url}/fragments/{'a' * 64}", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404
    ranged = httpx.get(f"{url}/fragments/{entry.sha256}",
                       headers={"Authorization": f"Bearer {TOKEN}", "Range": "bytes=10-19"})  # fmt: skip
    assert ranged.status_code == 206 and len(ranged.content) == 10
    with pytest.raises(FetchError, match="refused fragment embed \\(401\\): the node's token is missing, wrong or expired"):
        fetch_fragments(url, [entry], tmp_path / "cache", "wrong", progress=False)
    with pytest.raises(FetchError, match="401"):
        fetch_manifest(url, None)


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
    assert {(f.layer, f.experts) for f in chunks} == {(i, (e, e + 1)) for i in config.moe_layers for e in range(8)}
    assert all(".experts." not in t.name for i in config.moe_layers for t in manifest.fragment(f"layer.{i}").tensors)
    assert Manifest.from_json(json.loads(json.dumps(manifest.to_json()))) == manifest
    everything = (0, config.num_layers)
    for world in (2, 4):
        for rank in range(world):
            own = rank_ownership(config, rank, world)
            entries = fragments_for(manifest, everything, True, True, own.experts)
            assert {f.experts for f in entries if f.kind == "experts"} == {(e, e + 1) for e in range(*own.experts)}
            folder = _subset(tmp_path / "pkg", manifest, entries, tmp_path / f"rank{rank}of{world}")
            from_fragments = load_stage(FragmentSource(folder), own).state_dict()
            from_checkpoint = load_stage(open_source(built), own).state_dict()
            assert from_fragments.keys() == from_checkpoint.keys()
            assert all(torch.equal(from_fragments[k], from_checkpoint[k]) for k in from_checkpoint)
    assert len(fragments_for(manifest, everything, True, True)) == len(manifest.fragments)  # a whole stage: all
