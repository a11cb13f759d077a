"""Fetch a stage's fragments over HTTP into a cache keyed by sha256, then lay them out.

The cache holds ``<sha256>`` (complete, verified), ``<sha256>.verified`` (a stamp: the file's
size, modification time and inode when it last hashed right) and ``<sha256>.part`` (an
interrupted download, resumed with ``Range: bytes=N-``). A cached file is trusted without
reading it only while its stamp matches; a file changed since (a disk error, an edit, a copy
over it) is hashed again, and downloaded again if it no longer hashes to its name
(``rehash=True`` re-reads every cached file). Before downloading, a node checks that the
cache's disk has room, dropping stale partial downloads first; a download that fails on the
disk deletes its partial file.
"""

from __future__ import annotations

import logging
import os
import shutil
import ssl
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from seamline.errors import CheckpointError, SeamlineError
from seamline.weights.fragments import (
    MANIFEST_NAME,
    STAMP_SUFFIX,
    FragmentEntry,
    Manifest,
    file_sha256,
)

log = logging.getLogger(__name__)
PEER_CONNECT_TIMEOUT_S = (
    3.0  # a member's fragment port that does not answer by then is not asked again
)
DISK_MARGIN_BYTES = 64 << 20  # left free beyond the fragments
HASH_THREADS = 4


class FetchError(SeamlineError):
    """A fragment could not be fetched: refused (token), not served, or the link broke."""


class Unreachable(FetchError):
    """The server could not be connected to at all."""


@dataclass
class FetchReport:
    bytes_downloaded: int = 0
    fragments_downloaded: int = 0
    fragments_from_cache: int = 0
    bytes_from_peers: int = 0  # of bytes_downloaded


def trusting(certificate_pem: str) -> ssl.SSLContext | bool:
    """How a node verifies the coordinator's HTTPS: it trusts exactly the certificate the
    coordinator sent on its control link (a self-signed one too), by its key, at any address;
    with no certificate given, the system's CAs as usual."""
    if not certificate_pem:
        return True
    context = ssl.create_default_context(cadata=certificate_pem)
    context.check_hostname = False  # nodes reach the coordinator by whatever address the invite has
    context.verify_flags |= (
        ssl.VERIFY_X509_PARTIAL_CHAIN
    )  # the certificate itself is the trust anchor
    return context


def fetch_manifest(
    base_url: str,
    token: str | None = None,
    timeout: float = 30.0,
    verify: ssl.SSLContext | bool = True,
) -> Manifest:
    """The manifest served at ``<base_url>/fragments/manifest.json``."""
    url = f"{base_url.rstrip('/')}/fragments/{MANIFEST_NAME}"
    with httpx.Client(headers=_auth(token), timeout=timeout, verify=verify) as client:
        try:
            response = client.get(url)
        except httpx.HTTPError as exc:
            raise FetchError(f"cannot fetch the fragment manifest from {url}: {exc}") from None
        _check_status(response, url, "the manifest")
        try:
            return Manifest.from_json(response.json())
        except ValueError as exc:
            raise CheckpointError(f"{url} did not answer a JSON manifest: {exc}") from None


def fetch_fragments(
    base_url: str,
    entries: Iterable[FragmentEntry],
    cache_dir: str | Path,
    token: str | None = None,
    progress: bool = True,
    rehash: bool = False,
    timeout: float = 60.0,
    verify: ssl.SSLContext | bool = True,
    peers: Sequence[str] = (),
    on_progress: Callable[[int, int], None] | None = None,
) -> FetchReport:
    """Make every entry's file present and verified as ``cache_dir/<sha256>``: from the first of
    ``peers`` (members' fragment URLs, sent no token) that serves it intact, else from ``base_url``.
    ``on_progress(bytes done, bytes to fetch)`` follows the download as the bar does."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    unique = list({e.sha256: e for e in entries}.values())
    with ThreadPoolExecutor(
        max_workers=HASH_THREADS
    ) as pool:  # hashlib lets go of the GIL: files hash in parallel
        intact = list(pool.map(lambda e: _cached(e, cache, rehash), unique))
    todo = [e for e, ok in zip(unique, intact) if not ok]
    _make_room(cache, todo)
    report = FetchReport(fragments_from_cache=len(unique) - len(todo))
    total = sum(e.bytes for e in todo)
    bar = _Progress(
        tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="fragments",
            disable=not progress or not todo,
        ),
        total,
        on_progress,
    )
    peer_timeout = httpx.Timeout(timeout, connect=PEER_CONNECT_TIMEOUT_S)
    live_peers = list(peers)  # a peer that cannot be reached is not asked again
    with (
        bar,
        httpx.Client(headers=_auth(token), timeout=timeout, verify=verify) as client,
        httpx.Client(timeout=peer_timeout, verify=verify) as peer_client,
    ):
        for entry in todo:
            received = _from_peers(peer_client, live_peers, entry, cache, bar)
            if received is not None:
                report.bytes_from_peers += received
            else:
                received = _download(
                    client, f"{base_url.rstrip('/')}/fragments/{entry.sha256}", entry, cache, bar
                )
            report.bytes_downloaded += received
            report.fragments_downloaded += 1
    return report


class _Progress:
    """The download's progress bar, and whoever else follows it."""

    def __init__(self, bar: tqdm, total: int, follower: Callable[[int, int], None] | None) -> None:
        self.bar, self.total, self.follower, self.done = bar, total, follower, 0

    def update(self, count: int) -> None:
        self.bar.update(count)
        self.done += count
        if self.follower is not None:
            self.follower(self.done, self.total)

    def __enter__(self) -> _Progress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(*exc)


def _from_peers(
    client: httpx.Client, peers: list[str], entry: FragmentEntry, cache: Path, bar: Any
) -> int | None:
    """Bytes received for ``entry`` from the first peer that serves it whole and hashing right;
    None when none does. A peer's partial bytes are dropped, never resumed from elsewhere; a
    peer that cannot be reached is dropped from ``peers``."""
    for peer in list(peers):
        try:
            return _download(
                client, f"{peer.rstrip('/')}/fragments/{entry.sha256}", entry, cache, bar
            )
        except Unreachable as exc:
            peers.remove(peer)
            log.info("peer %s cannot be reached (%s): fragments come from elsewhere", peer, exc)
        except (FetchError, CheckpointError) as exc:
            (cache / f"{entry.sha256}.part").unlink(missing_ok=True)
            log.info("fragment %s not from peer %s: %s", entry.name, peer, exc)
    return None


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _cached(entry: FragmentEntry, cache: Path, rehash: bool) -> bool:
    """Whether the cache holds this fragment intact: its stamp matches, or it hashes right now."""
    path = cache / entry.sha256
    if not path.is_file():
        return False
    if path.stat().st_size == entry.bytes:
        if not rehash and _stamped(path):
            return True
        if file_sha256(path) == entry.sha256:
            _stamp(path)
            return True
    log.warning(
        "cached fragment %s at %s is damaged (it no longer hashes to its name); downloading it again",
        entry.name,
        path,
    )
    path.unlink()
    _stamp_path(path).unlink(missing_ok=True)
    return False


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + STAMP_SUFFIX)


def _signature(path: Path) -> str:
    """What any write to the file changes: its size, modification time and inode."""
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def _stamp(path: Path) -> None:
    """Record that ``path`` hashed right as it is now."""
    _stamp_path(path).write_text(_signature(path))


def _stamped(path: Path) -> bool:
    stamp = _stamp_path(path)
    try:
        return stamp.read_text() == _signature(path)
    except OSError:
        return False


def _make_room(cache: Path, todo: list[FragmentEntry]) -> None:
    """FetchError unless the cache's disk can take what is left to download (with a margin);
    partial downloads of other fragments are dropped first when it cannot."""
    wanted = {f"{e.sha256}.part" for e in todo}

    def need() -> int:
        return sum(e.bytes - _size(cache / f"{e.sha256}.part") for e in todo) + DISK_MARGIN_BYTES

    if not todo or shutil.disk_usage(cache).free >= need():
        return
    for stale in cache.glob("*.part"):
        if stale.name not in wanted:
            log.info("dropping a stale partial download %s to make room", stale)
            stale.unlink(missing_ok=True)
    free = shutil.disk_usage(cache).free
    if free < need():
        raise FetchError(
            f"the fragment cache {cache} has {free / 2**30:.2f} GiB free, but this node's layers need "
            f"{need() / 2**30:.2f} GiB more: free some space, or point SEAMLINE_CACHE at a larger disk"
        )


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _download(client: httpx.Client, url: str, entry: FragmentEntry, cache: Path, bar: Any) -> int:
    """Download (or resume) one fragment, verify it and move it into place; bytes received."""
    part = cache / f"{entry.sha256}.part"
    have = part.stat().st_size if part.is_file() else 0
    if have > entry.bytes:  # not a prefix of this fragment
        part.unlink()
        have = 0
    received = 0
    if have < entry.bytes:
        if have:
            log.info("resuming fragment %s at byte %d of %d", entry.name, have, entry.bytes)
        try:
            received = _stream(client, url, entry, part, have, bar)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise Unreachable(f"{url} cannot be reached: {exc}") from None
        except httpx.HTTPError as exc:
            raise FetchError(
                f"download of fragment {entry.name} from {url} broke off ({exc}); "
                f"run again to resume from the {part.stat().st_size if part.is_file() else 0} bytes kept"
            ) from None
        except OSError as exc:  # the disk: full, gone read-only
            part.unlink(missing_ok=True)
            raise FetchError(
                f"could not write fragment {entry.name} into {cache}: {exc}; "
                "the partial file was deleted"
            ) from None
    else:
        part.touch()  # a complete part (or an empty fragment): verify it as it is
        bar.update(have)
    _verify(part, entry, url)
    os.replace(part, cache / entry.sha256)
    _stamp(cache / entry.sha256)
    return received


def _stream(
    client: httpx.Client, url: str, entry: FragmentEntry, part: Path, have: int, bar: Any
) -> int:
    """GET the bytes after ``have`` into ``part``; a 200 answer to a Range restarts from 0."""
    headers = {"Range": f"bytes={have}-"} if have else {}
    with client.stream("GET", url, headers=headers) as response:
        if response.status_code == 416:  # the server's file is shorter than our part: restart
            response.close()
            part.unlink(missing_ok=True)
            return _stream(client, url, entry, part, 0, bar)
        _check_status(response, url, f"fragment {entry.name}")
        if have and not _resumes_at(response, have):
            log.info("server sent fragment %s whole; restarting it from byte 0", entry.name)
            have = 0
        bar.update(have)
        received = 0
        with open(part, "ab" if have else "wb") as f:
            for chunk in response.iter_bytes():  # as received: a broken link loses nothing
                if have + received + len(chunk) > entry.bytes:
                    _refuse(
                        part, entry, f"the server sent more than the manifest's {entry.bytes} bytes"
                    )
                f.write(chunk)
                received += len(chunk)
                bar.update(len(chunk))
    return received


def _resumes_at(response: httpx.Response, have: int) -> bool:
    """A 206 whose Content-Range starts at ``have``; anything else is the whole file."""
    if response.status_code != 206:
        return False
    content_range = response.headers.get("content-range", "")
    return content_range.startswith(f"bytes {have}-")


def _check_status(response: httpx.Response, url: str, what: str) -> None:
    if response.status_code in (200, 206):
        return
    response.read()
    detail = response.text[:200]
    if response.status_code in (401, 403):
        raise FetchError(
            f"{url} refused {what} ({response.status_code}): the node's token is missing, "
            f"wrong or expired: {detail}"
        )
    if response.status_code == 404:
        raise FetchError(f"{url} does not serve {what} (404): {detail}")
    raise FetchError(f"{url} answered {response.status_code} for {what}: {detail}")


def _verify(part: Path, entry: FragmentEntry, url: str) -> None:
    size = part.stat().st_size
    if size != entry.bytes:
        raise FetchError(
            f"fragment {entry.name} from {url} ended at {size} of {entry.bytes} bytes; "
            "run again to resume"
        )
    got = file_sha256(part)
    if got != entry.sha256:
        _refuse(part, entry, f"expected {entry.sha256}, got {got} (from {url})")


def _refuse(part: Path, entry: FragmentEntry, why: str) -> None:
    part.unlink(missing_ok=True)
    message = f"fragment {entry.name} hash mismatch: {why}; the bad file was deleted"
    log.error(message)
    raise CheckpointError(message)


def materialise(
    manifest: Manifest,
    entries: Iterable[FragmentEntry],
    cache_dir: str | Path,
    dest_dir: str | Path,
) -> Path:
    """Lay out ``entries`` (hard links to the cache, else symlinks, else copies) with the manifest.

    Files of an earlier manifest in ``dest_dir`` are removed first, so a fragment file there
    always belongs to the manifest beside it. The folder is what ``FragmentSource`` reads.
    """
    cache, dest = Path(cache_dir), Path(dest_dir)
    entries = list(entries)
    missing = [e.name for e in entries if not (cache / e.sha256).is_file()]
    if missing:
        raise CheckpointError(f"fragment {missing[0]} is not in the cache {cache}; fetch it first")
    dest.mkdir(parents=True, exist_ok=True)
    _clear(dest, manifest)
    for entry in entries:
        _link(cache / entry.sha256, dest / entry.file)
    manifest.save(dest)
    return dest


def _clear(dest: Path, manifest: Manifest) -> None:
    files = {f.file for f in manifest.fragments}
    try:
        files |= {f.file for f in Manifest.load(dest).fragments}
    except CheckpointError:
        pass  # no earlier manifest (or an unreadable one): its files are overwritten below
    (dest / MANIFEST_NAME).unlink(missing_ok=True)
    for file in files:
        (dest / file).unlink(missing_ok=True)


def _link(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.link-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # another filesystem, or no hard links
        try:
            os.symlink(src.resolve(), tmp)
        except OSError:
            shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
