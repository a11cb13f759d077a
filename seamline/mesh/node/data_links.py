"""Links between stages, and who may send a node frames on them.

The coordinator gives every plan a key and tells each stage which node may dial it: the stage
before it (hidden frames and the session messages that travel with them) and, for stage 0,
the last stage (tokens). The dialler answers the node's challenge with its node id and the
plan, under the key. Until it has, a link takes only the handshake's small control messages,
for at most ``HANDSHAKE_DEADLINE_S``; afterwards a frame is taken only from the link whose
role expects it. Over TLS both ends present certificates from the mesh CA, and each checks that
the other's names the node the plan put there. A node removed from the mesh is refused whatever
it says (its certificate is valid until it expires).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import ssl
from collections.abc import Collection

from seamline.errors import SeamlineError
from seamline.mesh.protocol.relay_wire import PAIR_WAIT_S, RELAY_MAGIC
from seamline.net.frames import (
    HANDSHAKE_DEADLINE_S,
    HANDSHAKE_LIMITS,
    LIMITS,
    HiddenFrame,
    TokenFrame,
)
from seamline.net.link import Link
from seamline.net.messages import (
    Assign,
    Challenge,
    Close,
    DataHello,
    Forget,
    Fork,
    Open,
    ProbeHello,
)

UPSTREAM, LAST, PROBE = "upstream", "last", "probe"
FROM_UPSTREAM = (HiddenFrame, Open, Fork, Forget, Close)


class LinkRefused(SeamlineError):
    """A peer on the data port that is not the planned sender."""


def data_proof(key: str, nonce: str, node_id: str, plan_id: int) -> str:
    return hmac.new(
        key.encode(), f"data:{nonce}:{node_id}:{plan_id}".encode(), hashlib.sha256
    ).hexdigest()


def dial(
    address: tuple[str, int],
    peer_node: str,
    node_id: str,
    assign: Assign,
    tls: ssl.SSLContext | None = None,
    relay_ticket: str = "",
) -> Link:
    """A link to the next stage (or, from the last stage, to stage 0), ``peer_node``, proved as
    ``node_id``; over TLS when ``tls`` is given, refused unless the peer's certificate names
    ``peer_node``. With ``relay_ticket``, ``address`` is the coordinator's relay."""
    preamble = RELAY_MAGIC + relay_ticket.encode() if relay_ticket else b""
    link = Link.connect(
        *address,
        name=f"{address[0]}:{address[1]}",
        tls=tls,
        preamble=preamble,
        timeout=PAIR_WAIT_S if relay_ticket else 10.0,
    )
    if tls is not None and link.peer_id() != peer_node:
        link.close()
        raise LinkRefused(
            f"{link.name} presented a certificate for {link.peer_id()!r}, not the planned {peer_node!r}"
        )
    link.limits = HANDSHAKE_LIMITS
    challenge = link.recv(deadline_s=HANDSHAKE_DEADLINE_S)
    if not isinstance(challenge, Challenge):
        link.close()
        raise LinkRefused(f"{link.name} sent {type(challenge).__name__} instead of a challenge")
    proof = data_proof(assign.link_key, challenge.nonce, node_id, assign.plan_id)
    link.send_message(DataHello(node_id=node_id, plan_id=assign.plan_id, proof=proof))
    link.limits = LIMITS
    return link


def admit(
    link: Link, assign: Assign | None, certified: bool = False, revoked: Collection[str] = ()
) -> str:
    """Challenge a link to this node's data port; its role (``UPSTREAM``, ``LAST``, or ``PROBE``:
    a member measuring the link, see ``peer_probe``), or LinkRefused. ``certified``: the link is TLS
    and its certificate must name the node the hello names; ``revoked``: removed nodes."""
    link.limits = HANDSHAKE_LIMITS
    nonce = secrets.token_hex(16)
    link.send_message(Challenge(nonce=nonce))
    hello = link.recv(deadline_s=HANDSHAKE_DEADLINE_S)
    named = getattr(hello, "node_id", "")
    if named in revoked or link.peer_id() in revoked:
        raise LinkRefused(f"node {link.peer_id() or named} was removed from the mesh")
    if isinstance(hello, ProbeHello):
        if certified and link.peer_id() != hello.node_id:
            raise LinkRefused(
                f"a certificate for {link.peer_id()!r} probed as node {hello.node_id}"
            )
        link.name = f"probe from {hello.node_id}"
        return PROBE
    if not isinstance(hello, DataHello):
        raise LinkRefused(f"expected a data hello, got {type(hello).__name__}")
    if assign is None or not assign.link_key or hello.plan_id != assign.plan_id:
        raise LinkRefused(
            f"node {hello.node_id} dialled for plan {hello.plan_id}, which this node does not serve"
        )
    roles = {assign.upstream_node: UPSTREAM, assign.last_node: LAST}
    role = roles.get(hello.node_id) if hello.node_id else None
    if role is None:
        raise LinkRefused(f"node {hello.node_id} is not a planned sender to this stage")
    if certified and link.peer_id() != hello.node_id:
        raise LinkRefused(
            f"a certificate for {link.peer_id()!r} claimed to be node {hello.node_id}"
        )
    if not hmac.compare_digest(
        hello.proof, data_proof(assign.link_key, nonce, hello.node_id, hello.plan_id)
    ):
        raise LinkRefused(f"node {hello.node_id} did not prove the plan's link key")
    link.limits = LIMITS
    link.name = f"{role} {hello.node_id}"
    return role


def expected_from(frame: object, role: str) -> bool:
    """Whether a link of ``role`` may send ``frame``."""
    return isinstance(frame, TokenFrame) if role == LAST else isinstance(frame, FROM_UPSTREAM)
