"""A node's load step: fetch exactly the fragments of its assignment, verify, build its Stage."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

from seamline.config import ModelConfig
from seamline.errors import CheckpointError
from seamline.mesh.node.fetch import (
    FetchReport,
    fetch_fragments,
    fetch_manifest,
    materialise,
    trusting,
)
from seamline.mesh.protocol.invite import Invite
from seamline.model.devices import resolve_device
from seamline.model.stage import Stage
from seamline.net.messages import Assign
from seamline.net.tls import GroupTls
from seamline.ownership import Ownership, rank_ownership
from seamline.runtime.lockstep_group import LockstepRank
from seamline.weights.fragments import FragmentSource, fragments_for
from seamline.weights.loader import DTYPES, load_stage

if TYPE_CHECKING:
    from seamline.mesh.node.process import NodeOptions

log = logging.getLogger("seamline.node")
Progress = Callable[[int, int], None]  # (bytes fetched, bytes to fetch)
GROUP_CONNECT_TIMEOUT_S = 600.0  # peers may still be downloading their fragments


def load_assignment(
    invite: Invite,
    assign: Assign,
    options: NodeOptions,
    tls: ssl.SSLContext | None = None,
    on_progress: Progress | None = None,
) -> tuple[Stage, FetchReport]:
    """Return the loaded Stage and what was downloaded for it (over mutual TLS with ``tls``,
    this member's client context, when the mesh runs over TLS)."""
    source, report = fetch_assignment(invite, assign, options, tls, on_progress)
    config = ModelConfig.from_hf_dict(source.config_dict())
    own = Ownership(layers=(assign.layers[0], assign.layers[1]))
    stage = load_stage(
        source,
        own,
        DTYPES[assign.dtype],
        config,
        mtp=assign.mtp,
        device=resolve_device(options.device),
        gpu_layers=assign.gpu_layers,
    )
    return stage, report


def load_rank(
    invite: Invite,
    assign: Assign,
    options: NodeOptions,
    tls: GroupTls | None = None,
    fetch_tls: ssl.SSLContext | None = None,
    on_progress: Progress | None = None,
) -> tuple[LockstepRank, FetchReport]:
    """This node's rank of a lockstep group: its shard of the range, joined to its peers.
    Of the routed experts it fetches only its own chunks; the layers' other fragments are
    fetched whole, and only the rank's slices are read from them."""
    source, report = fetch_assignment(invite, assign, options, fetch_tls, on_progress)
    rank, world = assign.shard
    log.info("rank %d of %d: joining the group over %s", rank, world, assign.transport)
    member = LockstepRank(
        source,
        rank,
        world,
        [(host, port) for host, port in assign.group],
        assign.gate_timeout_s,
        DTYPES[assign.dtype],
        GROUP_CONNECT_TIMEOUT_S,
        transport=assign.transport,  # type: ignore[arg-type]
        layers=assign.layers,
        identity=assign.model_hash,
        tls=tls,
        device=resolve_device(options.device),
    )
    return member, report


def fetch_assignment(
    invite: Invite,
    assign: Assign,
    options: NodeOptions,
    tls: ssl.SSLContext | None = None,
    on_progress: Progress | None = None,
) -> tuple[FragmentSource, FetchReport]:
    """Fetch (or find in the cache) the fragments of the assigned range, from the members that
    hold them where they can, over this member's mutual TLS only; open them."""
    verify = tls if tls is not None else trusting(assign.fragments_certificate)
    manifest = fetch_manifest(assign.fragments_url, token=assign.fragments_token, verify=verify)
    if manifest.model_hash != assign.model_hash:
        raise CheckpointError(
            f"coordinator serves model {manifest.model_hash[:12]} but assigned {assign.model_hash[:12]}"
        )
    experts = None
    if assign.shard[1] > 1:  # a lockstep rank: only the chunks of its routed experts
        experts = rank_ownership(ModelConfig.from_hf_dict(manifest.config), *assign.shard).experts
    entries = fragments_for(
        manifest, assign.layers, assign.owns_embedding, assign.owns_head, experts, assign.mtp
    )
    cache = options.cache_dir / "fragments"
    peers = (
        assign.fragment_peers if tls is not None else []
    )  # a member's certificate is their only key
    # every cached fragment is hashed as it is read for loading (the read happens anyway): a file
    # damaged in place, its size and modification time as before, is fetched again, never loaded
    report = fetch_fragments(
        assign.fragments_url,
        entries,
        cache,
        token=assign.fragments_token,
        progress=options.progress,
        verify=verify,
        peers=peers,
        on_progress=on_progress,
        rehash=True,
    )
    folder = materialise(manifest, entries, cache, options.cache_dir / "stages" / options.node_id)
    log.info(
        "layers [%d,%d): %d fragments, %d bytes downloaded (%d from peers), %d from cache",
        *assign.layers,
        len(entries),
        report.bytes_downloaded,
        report.bytes_from_peers,
        report.fragments_from_cache,
    )
    return FragmentSource(folder, manifest), report
