"""Serve a package folder's fragments by sha256 over HTTP (the coordinator, or any peer).

``GET /fragments/manifest.json`` answers the manifest; ``GET /fragments/{sha256}`` answers
that fragment's file, with HTTP Range (starlette's FileResponse: 206 with Content-Range, 416
past the end) so a node resumes an interrupted download. A request whose bearer token
``check_token`` refuses gets 401; a hash the folder's manifest does not name, or whose file
the folder lacks (a peer holding part of the model), gets 404. The manifest is re-read when
its file changes, so a peer whose folder is re-materialised serves its new fragments.

On their own HTTPS port (``serve_fragments``) a ``PeerGate`` also checks the node id the
client's certificate names: a removed member's certificate is valid until it expires, so the
TLS handshake alone still takes it. The port counts each connection from its accept on, before
TLS (``net.tls_gate``): a stranger's connections that never handshake are bounded as the control
port's are.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import uvicorn
from fastapi import APIRouter, FastAPI, Header, HTTPException
from fastapi.responses import FileResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from seamline.net.http_guard import bounded
from seamline.net.link import listen
from seamline.net.tls import certificate_name
from seamline.net.tls_gate import GatedServer
from seamline.weights.fragments import MANIFEST_NAME, STAMP_SUFFIX, FragmentEntry, Manifest

TokenCheck = Callable[[str | None], bool]
FragmentCheck = Callable[[str | None, FragmentEntry], bool]
log = logging.getLogger("seamline.fragments")


class PeerGate:
    """Which members the fragment port takes now: a connection whose certificate names a node
    ``refused`` says was removed is closed as it opens, and ``drop`` closes those already open."""

    def __init__(self, refused: Callable[[str], bool]) -> None:
        self.refused = refused
        self._open: dict[asyncio.BaseTransport, str] = {}  # touched on the server's event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._logged: set[str] = set()  # one line per removed node, however often it dials

    def protocol(self) -> type[H11Protocol]:
        """uvicorn's HTTP/1.1 protocol, told of each connection as it opens and closes."""
        gate = self

        class GatedProtocol(H11Protocol):
            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                super().connection_made(transport)
                gate._opened(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                gate._open.pop(self.transport, None)
                super().connection_lost(exc)

        return GatedProtocol

    def drop(self) -> None:
        """Close every open connection whose node is now refused (from any thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._drop)

    def _opened(self, transport: asyncio.Transport) -> None:
        self._loop = asyncio.get_running_loop()
        peer = certificate_name(transport.get_extra_info("peercert") or {})
        self._open[transport] = peer
        self._drop()

    def _drop(self) -> None:
        for transport, peer in list(self._open.items()):
            if self.refused(peer):
                if peer not in self._logged:
                    self._logged.add(peer)
                    log.warning(
                        "closed fragment connections from node %s: it was removed from the mesh",
                        peer,
                    )
                del self._open[transport]
                transport.close()


_SHA256 = re.compile(r"[0-9a-f]{64}")  # a held file is named by its hash: nothing else is looked up


class _PackageIndex:
    """sha256 -> fragment for one folder, reloaded when manifest.json changes; and, where
    ``held`` is given (a node's fragment cache, ``<sha256>`` files verified when fetched), any
    fragment held there: a node re-planned to other layers still serves what it fetched before
    (its peers, loading at the same time, would otherwise find it gone from the folder)."""

    def __init__(self, folder: Path, held: Path | None = None) -> None:
        self.folder = folder
        self.held = held
        self._stamp: tuple[int, int] | None = None
        self._by_hash: dict[str, FragmentEntry] = {}

    def manifest_path(self) -> Path:
        path = self.folder / MANIFEST_NAME
        if not path.is_file():
            raise HTTPException(404, f"no fragment manifest in {self.folder.name}")
        return path

    def lookup(self, sha256: str) -> Path:
        return self.lookup_entry(sha256)[1]

    def lookup_entry(self, sha256: str) -> tuple[FragmentEntry | None, Path]:
        """The fragment's entry and file; a held fragment has no entry (the fetcher checks its hash)."""
        try:
            return self._listed(sha256)
        except HTTPException:
            if (held := self._held(sha256)) is None:
                raise
            return None, held

    def _held(self, sha256: str) -> Path | None:
        if self.held is None or not _SHA256.fullmatch(sha256):
            return None
        file = self.held / sha256
        return (
            file if file.is_file() and (self.held / f"{sha256}{STAMP_SUFFIX}").is_file() else None
        )

    def _listed(self, sha256: str) -> tuple[FragmentEntry, Path]:
        path = self.manifest_path()
        stat = path.stat()
        if self._stamp != (stat.st_mtime_ns, stat.st_size):
            manifest = Manifest.load(path)
            self._by_hash = {f.sha256: f for f in manifest.fragments}
            self._stamp = (stat.st_mtime_ns, stat.st_size)
        entry = self._by_hash.get(sha256)
        file = self.folder / entry.file if entry is not None else None
        if entry is None or file is None or not file.is_file():
            raise HTTPException(404, f"no fragment with sha256 {sha256} is served here")
        return entry, file


def fragment_routes(
    app: FastAPI | APIRouter,
    package_dir: str | Path,
    check_token: TokenCheck,
    may_fetch: FragmentCheck | None = None,
    held: Path | None = None,
) -> None:
    """Add the two fragment routes for ``package_dir`` to ``app``; ``may_fetch(token, fragment)``:
    whether that token's holder may have that fragment (a private mesh keeps its ends' own);
    ``held``: a fragment cache whose verified fragments are served too (never with ``may_fetch``)."""
    index = _PackageIndex(Path(package_dir), held if may_fetch is None else None)

    def authorise(authorization: str | None) -> None:
        if not check_token(_bearer(authorization)):
            raise HTTPException(
                401,
                "fragment request refused: the bearer token is missing, wrong or expired",
                headers={"WWW-Authenticate": "Bearer"},
            )

    @app.get(f"/fragments/{MANIFEST_NAME}")
    def fragment_manifest(authorization: Annotated[str | None, Header()] = None) -> FileResponse:
        authorise(authorization)
        return FileResponse(index.manifest_path(), media_type="application/json")

    @app.get("/fragments/{sha256}")
    def fragment_file(
        sha256: str, authorization: Annotated[str | None, Header()] = None
    ) -> FileResponse:
        authorise(authorization)
        entry, path = index.lookup_entry(sha256.lower())
        if (
            may_fetch is not None
            and entry is not None
            and not may_fetch(_bearer(authorization), entry)
        ):
            raise HTTPException(
                403, f"fragment {entry.name} is not served to this member: a private mesh keeps it"
            )
        return FileResponse(path, media_type="application/octet-stream")


def serve_fragments(
    package_dir: Path,
    check_token: TokenCheck,
    host: str,
    port: int,
    context: ssl.SSLContext,
    gate: PeerGate | None = None,
    may_fetch: FragmentCheck | None = None,
    held: Path | None = None,
    listener: socket.socket | None = None,
) -> uvicorn.Server:
    """The fragment routes on their own HTTPS port, under ``context``: a mesh's, which takes only
    clients presenting a member's certificate from the mesh CA (mutual TLS 1.3), and of those
    only the members ``gate`` takes. ``listener``: a socket already listening on ``host:port``,
    served instead of binding the port anew."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    fragment_routes(app, package_dir, check_token, may_fetch, held)
    gate = gate or PeerGate(lambda _node: False)
    limits = bounded(gate.protocol())
    listener = listener or listen(host, port)
    listener.listen(limits["backlog"])
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", http=limits["http"], loop="asyncio"
    )
    server = GatedServer(config, listener, context, "fragments")
    threading.Thread(target=server.run, name="seamline-fragments", daemon=True).start()
    return server


def _bearer(authorization: str | None) -> str | None:
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None
