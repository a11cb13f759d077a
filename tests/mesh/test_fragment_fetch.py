"""Fragments over the network: a node fetches its stage's fragments from the coordinator's
fragment server or a peer, with resume, a verified cache, bounded disk and a token; served
by real uvicorn on 127.0.0.1 from the tiny model's package."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from seamline.errors import CheckpointError
from seamline.mesh.node.fetch import (
    FetchError,
    fetch_fragments,
    fetch_manifest,
    materialise,
)
from seamline.net.link import free_port
from seamline.ownership import Ownership
from seamline.text import TextCodec
from seamline.weights.fragments import (
    FragmentSource,
    Manifest,
    file_sha256,
)
from seamline.weights.loader import load_stage
from seamline.weights.packaging import package
from tests.support.api import serve_app
from tests.support.fragments import LAYERS, TOKEN, build_tiny, fragment_range
from tests.support.small_disk import small_file_system


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_package(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    out = tmp_path_factory.mktemp("tiny_package")
    return out, package(tiny, out, progress=False)


# ---------------------------------------------------------------- serving and fetching


@pytest.fixture()
def served(
    tiny_package: tuple[Path, Manifest], tmp_path: Path
) -> Iterator[tuple[str, Path, Manifest]]:
    """A copy of the tiny package (so a test may tamper with it), served by real uvicorn."""
    from fastapi import FastAPI

    from seamline.mesh.protocol.fragment_server import fragment_routes

    folder = tmp_path / "served"
    shutil.copytree(tiny_package[0], folder)
    app = FastAPI()
    fragment_routes(app, folder, lambda token: token == TOKEN)
    with serve_app(app) as url:
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
    with serve_app(_plain_server(data, cut=entry.bytes // 2), "critical") as broken:
        with pytest.raises(FetchError, match="broke off .* run again to resume"):
            fetch_fragments(broken, [entry], cache, progress=False)
    assert part.stat().st_size == entry.bytes // 2
    with serve_app(_plain_server(data)) as whole:  # answers a Range request with 200: restart
        assert (
            fetch_fragments(whole, [entry], cache, progress=False).bytes_downloaded == entry.bytes
        )
    (cache / entry.sha256).rename(part)  # complete but unverified: verified without a request
    report = fetch_fragments(url, [entry], cache, TOKEN, progress=False)
    assert report.bytes_downloaded == 0 and file_sha256(cache / entry.sha256) == entry.sha256


def test_fetch_range_then_cache(served: tuple[str, Path, Manifest], tmp_path: Path) -> None:
    url, _, manifest = served
    assert fetch_manifest(url, TOKEN) == manifest
    entries = fragment_range(manifest, 2, LAYERS)
    cache = tmp_path / "cache"
    followed: list[tuple[int, int]] = []  # what a node reports to the coordinator as it downloads
    report = fetch_fragments(
        url, entries, cache, TOKEN, progress=False, on_progress=lambda *p: followed.append(p)
    )
    total = sum(e.bytes for e in entries)
    assert report.bytes_downloaded == total
    assert (report.fragments_downloaded, report.fragments_from_cache) == (len(entries), 0)
    assert followed[-1] == (total, total) and {t for _, t in followed} == {total}
    assert [d for d, _ in followed] == sorted(d for d, _ in followed) and len(followed) >= len(
        entries
    )
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
    with (
        caplog.at_level(logging.ERROR),
        pytest.raises(
            CheckpointError, match=f"fragment layer.3 hash mismatch: expected {entry.sha256}, got"
        ),
    ):
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
    entries = fragment_range(manifest, 0, LAYERS)
    cache = tmp_path / "cache"
    fetch_fragments(url, entries, cache, TOKEN, progress=False)
    time.sleep(0.05)  # a later write: file times tick coarsely
    damaged = [manifest.fragment("layer.1"), manifest.fragment("layer.2")]
    for entry in damaged:
        _flip_a_byte(cache / entry.sha256)
    again = fetch_fragments(url, entries, cache, TOKEN, progress=False)
    assert (again.fragments_downloaded, again.bytes_downloaded) == (
        2,
        sum(e.bytes for e in damaged),
    )
    assert all(file_sha256(cache / e.sha256) == e.sha256 for e in entries)
    hidden = cache / damaged[0].sha256
    times = hidden.stat().st_atime_ns, hidden.stat().st_mtime_ns
    _flip_a_byte(hidden)
    os.utime(hidden, ns=times)
    assert fetch_fragments(url, entries, cache, TOKEN, progress=False).fragments_downloaded == 0
    assert (
        fetch_fragments(
            url, entries, cache, TOKEN, progress=False, rehash=True
        ).fragments_downloaded
        == 1
    )
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
    assign = Assign(
        plan_id=1,
        model_hash=manifest.model_hash,
        fragments_url=url,
        fragments_token=TOKEN,
        layers=(0, LAYERS),
        owns_embedding=True,
        owns_head=True,
        dtype="float32",
        context_length=64,
    )
    options = NodeOptions(node_id="n1", cache_dir=tmp_path / "node", progress=False)
    assert fetch_assignment(None, assign, options)[1].fragments_from_cache == 0  # type: ignore[arg-type]
    hidden = options.cache_dir / "fragments" / manifest.fragment("layer.2").sha256
    times = hidden.stat().st_atime_ns, hidden.stat().st_mtime_ns
    _flip_a_byte(hidden)
    os.utime(hidden, ns=times)
    _, report = fetch_assignment(None, assign, options)  # type: ignore[arg-type]
    assert (report.fragments_downloaded, report.bytes_downloaded) == (
        1,
        manifest.fragment("layer.2").bytes,
    )
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


def test_a_disk_without_room_is_refused_before_downloading(
    served: tuple[str, Path, Manifest], small_disk: Path
) -> None:
    url, _, manifest = served
    stale = small_disk / f"{'f' * 64}.part"
    stale.write_bytes(b"x" * 1000)
    with pytest.raises(
        FetchError, match="GiB free, but this node's layers need .* GiB more: free some space"
    ):
        fetch_fragments(url, fragment_range(manifest, 0, LAYERS), small_disk, TOKEN, progress=False)
    assert not stale.exists()  # a partial download of another fragment was dropped to make room
    assert [p for p in small_disk.iterdir()] == []


def test_fragments_come_from_a_peer_that_serves_them_intact_else_from_the_coordinator(
    served: tuple[str, Path, Manifest],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Peers are asked in order: one cannot be reached (not asked again), one answers garbage for
    everything (dropped: it fails the hash), one holds layers [0,2) only (those come from it,
    without the node's token); the rest come from the coordinator. Every fragment lands verified."""
    from fastapi import FastAPI

    from seamline.mesh.protocol.fragment_server import fragment_routes

    url, folder, manifest = served
    held = {e.sha256 for e in fragment_range(manifest, 0, 2)}
    holder = tmp_path / "peer"
    shutil.copytree(folder, holder)
    for entry in manifest.fragments:
        if entry.sha256 not in held:
            (holder / entry.file).unlink()
    tokens: list[str | None] = []
    peer = FastAPI()
    fragment_routes(peer, holder, lambda token: tokens.append(token) is None)
    entries = fragment_range(manifest, 0, LAYERS)
    with serve_app(_plain_server(b"not this fragment")) as liar, serve_app(peer) as holding:
        gone = f"http://127.0.0.1:{free_port()}"
        caplog.set_level(logging.INFO, logger="seamline.mesh.node.fetch")
        report = fetch_fragments(
            url, entries, tmp_path / "cache", TOKEN, progress=False, peers=[gone, liar, holding]
        )
    from_peer = sum(e.bytes for e in {e.sha256: e for e in entries}.values() if e.sha256 in held)
    assert 0 < report.bytes_from_peers == from_peer < report.bytes_downloaded
    assert tokens and set(tokens) == {None}  # the node's bearer token is for the coordinator alone
    for entry in entries:
        assert file_sha256(tmp_path / "cache" / entry.sha256) == entry.sha256
    assert not list((tmp_path / "cache").glob("*.part"))
    assert sum(f"peer {gone} cannot be reached" in r.getMessage() for r in caplog.records) == 1


def test_a_peer_serves_the_verified_fragments_it_holds_after_its_folder_changed(
    served: tuple[str, Path, Manifest], tmp_path: Path
) -> None:
    """A node re-planned to other layers rewrites its stage folder while its peers load: it still
    serves what its cache holds verified (a file named by its hash, with its stamp), and nothing
    else there (no stamp, or a name that is no hash: 404)."""
    import httpx
    from fastapi import FastAPI

    from seamline.mesh.protocol.fragment_server import fragment_routes

    url, _, manifest = served
    held = tmp_path / "held"
    fetch_fragments(url, fragment_range(manifest, 0, 2), held, TOKEN, progress=False)
    stage_folder = tmp_path / "stage"  # the new assignment's folder: no manifest yet
    stage_folder.mkdir()
    peer = FastAPI()
    fragment_routes(peer, stage_folder, lambda _token: True, held=held)
    entries = list({e.sha256: e for e in fragment_range(manifest, 0, 2)}.values())
    unstamped = entries[-1].sha256
    (held / f"{unstamped}.verified").unlink()
    (held / "notes").write_text("not a fragment")
    with serve_app(peer) as holding:
        report = fetch_fragments(
            url, entries[:-1], tmp_path / "cache", TOKEN, progress=False, peers=[holding]
        )
        assert report.bytes_from_peers == sum(e.bytes for e in entries[:-1]) > 0
        assert httpx.get(f"{holding}/fragments/{unstamped}").status_code == 404
        assert httpx.get(f"{holding}/fragments/notes").status_code == 404
        assert httpx.get(f"{holding}/fragments/{'b' * 64}").status_code == 404


def test_bad_token_is_refused(served: tuple[str, Path, Manifest], tmp_path: Path) -> None:
    import httpx

    url, _, manifest = served
    entry = manifest.fragment("embed")
    assert httpx.get(f"{url}/fragments/{entry.sha256}").status_code == 401
    assert (
        httpx.get(
            f"{url}/fragments/{'a' * 64}", headers={"Authorization": f"Bearer {TOKEN}"}
        ).status_code
        == 404
    )
    ranged = httpx.get(
        f"{url}/fragments/{entry.sha256}",
        headers={"Authorization": f"Bearer {TOKEN}", "Range": "bytes=10-19"},
    )
    assert ranged.status_code == 206 and len(ranged.content) == 10
    with pytest.raises(
        FetchError,
        match="refused fragment embed \\(401\\): the node's token is missing, wrong or expired",
    ):
        fetch_fragments(url, [entry], tmp_path / "cache", "wrong", progress=False)
    with pytest.raises(FetchError, match="401"):
        fetch_manifest(url, None)
