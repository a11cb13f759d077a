"""A private mesh's two ends on one node (``--private``): the coordinator's own node holds the
embedding with the first layers (stage 0) and the last layers with the head (the last stage),
and the members hold what lies between. The last stage draws with stage 0's records (the
sampling a request asked for, the tokens so far), hands its tokens to stage 0 in this process,
and both key the rows' prefix hashes: no token id, prompt or answer crosses a member."""

from __future__ import annotations

import dataclasses
import secrets
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

from seamline.mesh.node.fetch import FetchReport
from seamline.mesh.node.loading import load_assignment
from seamline.mesh.protocol.invite import Invite
from seamline.net.frames import TokenFrame
from seamline.net.messages import Assign
from seamline.runtime.grammar import TokenMasks
from seamline.runtime.stage_worker import StageWorker

if TYPE_CHECKING:
    from seamline.mesh.node.process import NodeOptions

TAIL_SUFFIX = ".tail"  # the last stage's folder beside stage 0's (a node id may hold dots)


def tail_assignment(assign: Assign) -> Assign:
    """The last stage's share of a private mesh's first assignment."""
    assert assign.tail is not None
    return assign.model_copy(
        update={"layers": assign.tail, "owns_embedding": False, "owns_head": True, "tail": None}
    )


def load_tail(
    invite: Invite,
    assign: Assign,
    options: NodeOptions,
    tls: ssl.SSLContext | None,
    on_progress: Callable[[int, int], None],
) -> tuple[StageWorker, FetchReport]:
    """The last stage's worker, its fragments in a folder of its own."""
    tail_options = dataclasses.replace(options, node_id=options.node_id + TAIL_SUFFIX)
    stage, fetched = load_assignment(
        invite, tail_assignment(assign), tail_options, tls, on_progress
    )
    tail = StageWorker(stage, False, True, assign.context_length)
    folder = tail_options.cache_dir / "stages" / tail_options.node_id
    tail.masks = TokenMasks(lambda: (folder / "tokenizer.json").read_text())
    return tail, fetched


def pair(first: StageWorker, tail: StageWorker) -> None:
    """Wire the two ends: tokens go from the last stage to stage 0 here; stage 0 sends the
    members no token id and no sampling parameter; prefix hashes are keyed by a secret of this
    process's own."""
    assert first.head is not None
    key = secrets.token_bytes(16)
    first.private, first.hash_key, first.head.hash_key = True, key, key
    tail.source, tail.hash_key = first.head, key
    tail.links.stage0 = lambda rows: first.tokens(TokenFrame(tuple(rows)))
