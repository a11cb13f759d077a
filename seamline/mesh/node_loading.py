"""A node's load step: fetch exactly the fragments of its assignment, verify, build its Stage."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING


from seamline.config import ModelConfig
from seamline.errors import CheckpointError
from seamline.mesh.fetch import fetch_fragments, fetch_manifest, materialise
from seamline.mesh.invite import Invite
from seamline.model.ownership import Ownership
from seamline.model.stage import Stage
from seamline.net.messages import Assign
from seamline.weights.fragments import FragmentSource, fragments_for
from seamline.weights.loader import DTYPES, load_stage

if TYPE_CHECKING:
    from seamline.mesh.node import NodeOptions

log = logging.getLogger("seamline.node")


def load_assignment(invite: Invite, assign: Assign, options: NodeOptions) -> tuple[Stage, int]:
    """Return the loaded Stage and the number of bytes downloaded for it."""
    manifest = fetch_manifest(assign.fragments_url, token=invite.secret)
    if manifest.model_hash != assign.model_hash:
        raise CheckpointError(
            f"coordinator serves model {manifest.model_hash[:12]} but assigned {assign.model_hash[:12]}"
        )
    entries = fragments_for(manifest, assign.layers, assign.owns_embedding, assign.owns_head)
    cache = options.cache_dir / "fragments"
    report = fetch_fragments(assign.fragments_url, entries, cache, token=invite.secret, progress=options.progress)
    folder = materialise(manifest, entries, cache, options.cache_dir / "stages" / options.node_id)
    log.info("layers [%d,%d): %d fragments, %d bytes downloaded, %d from cache", *assign.layers,
             len(entries), report.bytes_downloaded, report.fragments_from_cache)  # fmt: skip
    source = FragmentSource(folder, manifest)
    config = ModelConfig.from_hf_dict(source.config_dict())
    own = Ownership(layers=(assign.layers[0], assign.layers[1]))
    stage = load_stage(source, own, DTYPES[assign.dtype], config)
    return stage, report.bytes_downloaded
