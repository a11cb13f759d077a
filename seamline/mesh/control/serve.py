"""`seamline serve`: package the model, start the coordinator and the API, invite nodes."""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from seamline.config import ModelConfig
from seamline.errors import ConfigError
from seamline.mesh.arenas import tame_malloc
from seamline.mesh.control.admin import admin_key, admin_routes
from seamline.mesh.control.coordinator import Coordinator, CoordinatorOptions
from seamline.mesh.control.invites import InviteBook
from seamline.mesh.control.mesh_backend import MeshBackend
from seamline.mesh.control.startup import route_speculation
from seamline.mesh.identity import MeshAuthority
from seamline.mesh.plan.groups import check_world
from seamline.mesh.plan.types import ModelSpec, Plan
from seamline.mesh.protocol.fragment_server import (
    PeerGate,
    fragment_routes,
    serve_fragments,
)
from seamline.mesh.protocol.invite import Invite
from seamline.precision import Precision, apply, checked, resolve, weights_kind
from seamline.runtime.speculation import Speculation
from seamline.text import TextCodec
from seamline.weights.fragments import Manifest
from seamline.weights.loader import dtype_bytes, mtp_missing, open_source
from seamline.weights.packaging import package_cached

log = logging.getLogger("seamline.serve")


@dataclass
class ServeOptions:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    control_port: int = 0  # 0: port + 1
    advertise: tuple[str, ...] = ()  # addresses nodes use to reach us (default: host)
    nodes_expected: int = 1
    local_node: bool = True
    precision: str = "fast"  # ``seamline.precision``: decided here once, for every stage and rank
    dtype: str | None = None  # activations, overriding the precision's
    device: str = "auto"  # the local node's (``seamline.model.devices``)
    context: int = 0  # 0: the model's own
    invite_ttl_s: float = 24 * 3600
    lock_path: str | None = None
    tensor_parallel: int = 0  # ranks per stage (0: groups only where a stage needs one)
    transport: str = "auto"
    gate_timeout_s: float = 30.0
    replay_deadline_s: float = (
        120.0  # a request whose route was lost waits this long for the mesh to serve again
    )
    heartbeat_timeout_s: float = 3.0  # a member silent this long is lost
    verify_fraction: float = (
        0.0  # of requests the coordinator follows through its own copy (``verify``)
    )
    verify_node: str | None = None  # tests: followed requests check the stage it serves in
    private: bool = False  # the route's ends on this machine's own node: members see no token (``plan.private``)
    insecure_comm: bool = False  # --transport torch may run between hosts
    micro_batches: int = 0  # in flight in the pipeline (0: one per stage)
    kv_cache_bytes: int = 0  # stage 0's KV budget (0: most of its free memory)
    speculation: Speculation = field(
        default_factory=Speculation
    )  # stage 0 drafts, where the route allows
    tls_certificate: str = ""  # PEM: the API is served over HTTPS with it
    fragments_port: int = 0  # a mesh over TLS serves fragments here, to members only (0: port + 2)
    plaintext_links: bool = False  # no mesh CA, links unencrypted: only to measure what TLS costs
    state_dir: Path | None = None  # the mesh CA is kept here (default: <cache_dir>/mesh)
    cache_dir: Path = field(
        default_factory=lambda: Path(
            os.environ.get("SEAMLINE_CACHE", "~/.cache/seamline")
        ).expanduser()
    )


@dataclass
class Mesh:
    """Everything `serve` builds before the HTTP server runs (also used by `demo`): the
    coordinator, the API's backend, and the routes the coordinator adds to the API (fragment
    downloads, /api/status); ``server.mesh_app`` makes the app."""

    routes: Callable[[FastAPI], None]
    coordinator: Coordinator
    backend: MeshBackend
    invite: Invite
    token: str
    package_dir: Path
    state_dir: Path
    fragments_port: int = 0  # over mutual TLS (0: the API serves the fragments: a plaintext mesh)
    own_token: str = (
        ""  # the invite of this machine's own node (`serve`'s local node), for it alone
    )

    def start(self, host: str) -> None:
        """Open the control port, and the fragment port of a mesh over TLS."""
        self.coordinator.start(host)
        enrollment = self.coordinator.enrollment
        if self.fragments_port and enrollment is not None:
            self.coordinator.fragment_gate = PeerGate(enrollment.is_removed)
            serve_fragments(
                self.package_dir,
                self.coordinator.joining.fragment_token_ok,
                host,
                self.fragments_port,
                enrollment.identity.server_context(),
                self.coordinator.fragment_gate,
                self.coordinator.joining.fragment_allowed,
            )


ENDPOINT_FILE = (
    "endpoint.json"  # where `seamline invite` and `seamline node` find the running coordinator
)


def _write_endpoint(state_dir: Path, url: str, certificate_pem: str) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / ENDPOINT_FILE).write_text(json.dumps({"url": url, "certificate": certificate_pem}))


def _refuse_early(options: ServeOptions, path: Path) -> None:
    """What the options cannot do with this model, said before packaging (which may take minutes)."""
    if options.private and (not options.local_node or options.tensor_parallel):
        raise ConfigError(
            "--private keeps the route's ends on this machine's own node: it needs that node "
            "(no --no-local-node) and stages of one node each (no --tensor-parallel)"
        )
    if not options.tensor_parallel and options.speculation.mode != "mtp":
        return
    source = open_source(path)
    config = ModelConfig.from_hf_dict(source.config_dict())
    if options.tensor_parallel:
        check_world(config, options.tensor_parallel)
    # the last stage drafts with the layer and its own copy of the embedding
    if options.speculation.mode == "mtp" and (why := mtp_missing(source, config, embed=True)):
        raise ConfigError(f"--speculative mtp: {why}")


@dataclass(frozen=True)
class _Model:
    """What `serve` serves, decided once before the coordinator starts (``_prepare_model``)."""

    package_dir: Path
    manifest: Manifest
    config: ModelConfig
    codec: TextCodec
    context: int
    speculation: Speculation
    precision: Precision
    spec: ModelSpec


def build_mesh(options: ServeOptions) -> Mesh:
    """The model packaged, the coordinator and its invites made, the API's backend and routes."""
    tame_malloc()  # the coordinator runs a thread per connection: see arenas.py
    model = _prepare_model(options)
    hosts = options.advertise or (_reachable(options.host),)
    scheme = "https" if options.tls_certificate else "http"
    state_dir = options.state_dir or options.cache_dir / "mesh"
    authority = None if options.plaintext_links else MeshAuthority.load_or_create(state_dir)
    book, token, own_id, own_token = _invites(options, hosts, state_dir, authority)
    fragments_port = (options.fragments_port or options.port + 2) if authority else 0
    fragments_url = (
        f"https://{url_host(hosts[0])}:{fragments_port}"
        if fragments_port
        else f"{scheme}://{url_host(hosts[0])}:{options.port}"
    )
    coordinator = Coordinator(
        book,
        model.spec,
        model.manifest.model_hash,
        _coordinator_options(options, model, own_id, fragments_url, state_dir),
        authority,
    )
    backend = MeshBackend(
        coordinator,
        model.codec,
        model.manifest.model,
        model.context,
        replay_deadline_s=options.replay_deadline_s,
    )
    key = admin_key(state_dir)
    _write_endpoint(
        state_dir, f"{scheme}://{url_host(hosts[0])}:{options.port}", options.tls_certificate
    )
    return Mesh(
        _routes(coordinator, book, key, model.package_dir, fragments_port),
        coordinator,
        backend,
        Invite.decode(token),
        token,
        model.package_dir,
        state_dir,
        fragments_port,
        own_token,
    )


def _prepare_model(options: ServeOptions) -> _Model:
    """The model packaged into fragments (cached), its text codec checked, its precision applied
    here, and its shapes as the planner sees them."""
    from seamline.app import default_model_path

    path = Path(options.model) if options.model else default_model_path()
    _refuse_early(options, path)
    # a GGUF file's tokenizer and its BOS/EOS keys are checked before packaging reads its weights
    early = TextCodec.from_model(path) if path.suffix == ".gguf" else None
    package_dir = package_cached(path, options.cache_dir / "packages")
    manifest = Manifest.load(package_dir)
    config = ModelConfig.from_hf_dict(manifest.config)
    codec = early or TextCodec.from_model(path, config.eos_token_ids)
    codec.check_fits(config.vocab_size)  # before any node loads a layer
    # auto drafts with the model's multi-token-prediction layer (on the last stage) where it came packaged
    speculation = options.speculation.for_model(
        any(f.layer == manifest.num_layers for f in manifest.fragments)
    )
    context = options.context or config.max_position_embeddings
    shapes = {t.name: t.shape for f in manifest.fragments for t in f.tensors}
    types = {t.name: t.dtype for f in manifest.fragments for t in f.tensors}
    precision = resolve(options.precision, weights_kind(types.values()), options.dtype)
    if options.verify_fraction > 0:  # stages and the reference: every row as it would alone
        precision = checked(precision)
    apply(
        precision
    )  # the coordinator's own copy (start-up checks, ``--verify-fraction``) computes alike
    log.info("every stage computes in precision %s", precision.describe())
    mtp = (
        route_speculation(speculation.mode, options.private, options.verify_fraction) == "mtp"
    )  # the last stage holds it
    spec = ModelSpec.from_checkpoint_shapes(
        config, manifest.model, shapes, dtype_bytes(precision.dtype), types, context, mtp
    )
    return _Model(package_dir, manifest, config, codec, context, speculation, precision, spec)


def _invites(
    options: ServeOptions, hosts: tuple[str, ...], state_dir: Path, authority: MeshAuthority | None
) -> tuple[InviteBook, str, str, str]:
    """The invite book; the token `serve` prints (any number of nodes may join with it); the id
    and token of this machine's own node's invite (for it alone)."""
    where = Invite(
        hosts,
        options.control_port or options.port + 1,
        options.port,
        "",
        0.0,
        authority.fingerprint if authority else "",
    )
    book = InviteBook(where, state_dir / "invites.json")
    _, token = book.create(options.invite_ttl_s)  # the one `serve` prints: any number of nodes
    own, own_token = book.create(
        options.invite_ttl_s, uses=1
    )  # this machine's own node's, and no other's
    return book, token, own.id, own_token


def _coordinator_options(
    options: ServeOptions, model: _Model, own_id: str, fragments_url: str, state_dir: Path
) -> CoordinatorOptions:
    """The coordinator's settings: the options' with what the model decided."""
    precision, speculation = model.precision, model.speculation
    return CoordinatorOptions(
        nodes_expected=max(
            options.nodes_expected, options.tensor_parallel, 2 if options.private else 1
        ),
        dtype=precision.dtype,
        int8_activations=precision.int8_activations,
        rows_alone=precision.rows_alone,
        precision=precision.name,
        private=options.private,
        own_invite=own_id if options.local_node else "",
        context_length=model.context,
        fragments_url=fragments_url,
        fragments_certificate=options.tls_certificate,
        locked_plan=_locked(options.lock_path),
        model_config=model.config,
        tensor_parallel=options.tensor_parallel,
        transport=options.transport,
        gate_timeout_s=options.gate_timeout_s,
        insecure_comm=options.insecure_comm,
        micro_batches=options.micro_batches,
        kv_cache_bytes=options.kv_cache_bytes,
        heartbeat_timeout_s=options.heartbeat_timeout_s,
        state_dir=state_dir,
        package_dir=model.package_dir,
        verify_fraction=options.verify_fraction,
        verify_node=options.verify_node,
        speculation=speculation.mode,
        draft_max=speculation.draft_max,
    )


def _routes(
    coordinator: Coordinator, book: InviteBook, key: str, package_dir: Path, fragments_port: int
) -> Callable[[FastAPI], None]:
    """What the coordinator adds to the API: the fragments (a plaintext mesh's), /api/status and
    the admin routes."""

    def routes(app: FastAPI) -> None:
        if (
            not fragments_port
        ):  # a plaintext mesh: the API serves the fragments, to members' tokens only
            fragment_routes(
                app,
                package_dir,
                coordinator.joining.fragment_token_ok,
                coordinator.joining.fragment_allowed,
            )
        app.get("/api/status")(coordinator.status)
        admin_routes(app, coordinator, book, key)

    return routes


def _reachable(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _locked(path: str | None) -> Plan | None:
    if not path or not Path(path).is_file():
        return None
    return Plan.from_json(json.loads(Path(path).read_text()))


def spawn_node(
    token: str,
    node_id: str,
    cache_dir: Path | None = None,
    extra: list[str] | None = None,
    threads: int = 0,
) -> subprocess.Popen[bytes]:
    """A `seamline join` process; it is stopped when this process exits. ``threads``: its
    compute threads (0: all cores) — nodes sharing one machine should split its cores."""
    args = [
        sys.executable,
        "-m",
        "seamline.cli",
        "join",
        "--node-id",
        node_id,
        "--quiet",
        *(extra or []),
    ]
    env = {**os.environ, "SEAMLINE_INVITE": token}  # not argv, which `ps` shows
    if cache_dir is not None:
        env["SEAMLINE_CACHE"] = str(cache_dir)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen(
        args, env=env, preexec_fn=_ends_with_parent if sys.platform == "linux" else None
    )
    atexit.register(_stop, proc)
    return proc


def _ends_with_parent() -> None:
    """In the child: the kernel ends it when the process that started it dies however it dies
    (a killed `serve` runs no atexit, and its node would go on dialling it for an hour). The
    kernel watches the starting thread: nodes are started from the main thread."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_ready(coordinator: Coordinator, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not coordinator.ready.wait(timeout=0.2):
        if time.monotonic() > deadline:
            raise TimeoutError(f"mesh not ready after {timeout_s:.0f} s: {coordinator.state}")
    return coordinator.status()
