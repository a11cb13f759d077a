"""How a node becomes a member (the coordinator's side: ``Coordinator.joining``).

Over TLS a node joins in two connections to the control port. The first (the coordinator's
certificate only, checked by the node against the CA its invite pins) enrolls it: it proves
its invite and sends a signing request, and gets a certificate naming its node id. The second
is its control link proper: both certificates verified against the CA, and the node's must
name the node that just enrolled. It is then measured (its link, its claimed speed) and may be
planned. A plaintext mesh (benchmarks only) keeps the first connection as the control link.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING

from seamline.mesh.control import heartbeats
from seamline.mesh.control.mesh_state import NodeAdmitted, NodeJoined, NodeRemoved
from seamline.mesh.control.node_handle import NodeHandle
from seamline.mesh.control.relay import reachable
from seamline.mesh.identity import COORDINATOR_ID, IdentityError
from seamline.mesh.protocol.claims import SpeedCheck
from seamline.mesh.protocol.invite import coordinator_proof
from seamline.mesh.protocol.link_probe import measure
from seamline.mesh.protocol.relay_wire import RELAY_MAGIC
from seamline.net.frames import (
    HANDSHAKE_DEADLINE_S,
    HANDSHAKE_LIMITS,
    FrameError,
    FrameType,
)
from seamline.net.link import Link, LinkClosed, accept_links, listen
from seamline.net.messages import (
    PROTOCOL_VERSION,
    Attach,
    Attached,
    Certificate,
    Challenge,
    Join,
    MeasurePeer,
    Ping,
    Refuse,
    Rejoin,
    Renew,
    Revoked,
    Welcome,
    node_id_refusal,
)
from seamline.weights.fragments import FragmentEntry

if TYPE_CHECKING:
    from seamline.mesh.control.coordinator import Coordinator

PRIVATE_KINDS = (
    "embed",
    "head",
    "tokenizer",
)  # a private mesh's ends hold these; no member is sent them
log = logging.getLogger("seamline.coordinator")
ATTACH_WITHIN_S = 60.0  # an enrolled node opens its control link within this
# A member's control link takes what members send: its messages, whose every field is bounded
# (``messages``; the largest, a Renew or SpeedSums, is under 30 KiB), and the drawing stage's
# tokens; never a hidden frame, which only travels between stages.
MEMBER_LIMITS = {FrameType.CONTROL: 64 << 10, FrameType.HIDDEN: 0, FrameType.TOKEN: 1 << 20}
REVOKED_ANSWER_S = 2.0  # a removal waits this long for the members to confirm they refuse the node


def _peer_host(link: Link) -> str:
    """The address a link comes from ("" when it cannot say): nodes behind one NAT, or on one
    machine's loopback, share it."""
    try:
        return str(link.sock.getpeername()[0])
    except OSError:
        return ""


class Joining:
    """Joining, certificates and removal; members enter and leave the coordinator's state
    through its events."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.enrollment = coordinator.enrollment
        self.options = coordinator.options
        self._server: socket.socket | None = None
        self._fragment_tokens: dict[
            str, str
        ] = {}  # node id -> its bearer token for fragment downloads
        self._enrolled: dict[
            str, tuple[Join, float]
        ] = {}  # certified, not yet attached: (join, deadline)
        self._lock = threading.Lock()  # over the two above

    def start(self, host: str) -> int:
        c = self.coordinator
        self._server = server = listen(host, c.invite.control_port)
        accept_links(
            server,
            "control",
            self._handshake,
            tls=self._control_context,
            plain={RELAY_MAGIC: c.relay.serve},
        )
        heartbeats.watch(c, self.options.heartbeat_timeout_s)
        return int(server.getsockname()[1])

    def _control_context(self) -> ssl.SSLContext | None:
        return self.enrollment.control_context if self.enrollment is not None else None

    def _handshake(self, link: Link) -> None:
        peer = link.peer()
        link.limits = HANDSHAKE_LIMITS  # nothing large from a peer that has not proved itself
        try:
            nonce = secrets.token_hex(16)
            link.send_message(
                self.enrollment.challenge(nonce) if self.enrollment else Challenge(nonce=nonce)
            )
            first = link.recv(deadline_s=HANDSHAKE_DEADLINE_S)
            claimed = (
                first.join.node_id if isinstance(first, Rejoin) else getattr(first, "node_id", None)
            )
            if isinstance(claimed, str) and (bad := node_id_refusal(claimed)):
                self._refuse(link, peer, bad, final=True)
            elif isinstance(first, Attach):
                self._attach(link, first, peer)
            elif isinstance(first, Rejoin):
                self._rejoin(link, first.join, peer)
            else:
                self._enroll(link, first, nonce, peer)
        except (LinkClosed, FrameError) as exc:
            log.warning("join from %s failed: %s", peer, exc)
            link.close()

    def _refuse(self, link: Link, peer: str, reason: str, final: bool = False) -> None:
        log.warning("refused node from %s: %s", peer, reason)
        link.send_message(Refuse(reason=reason, final=final))
        link.close()

    def _enroll(self, link: Link, join: object, nonce: str, peer: str) -> None:
        reason, secret = self._refusal(join, nonce)
        certificate = self._certify(join) if not reason else ""
        if reason or certificate is None:
            self._refuse(link, peer, reason or "its certificate signing request does not check out")
            return
        assert isinstance(join, Join)
        if self.enrollment is None:  # plaintext: this connection is the control link
            link.send_message(
                Welcome(node_id=join.node_id, proof=coordinator_proof(secret, join.nonce))
            )
            self._enter(join, link, peer)
            return
        with self._lock:
            self._enrolled[join.node_id] = (join, time.monotonic() + ATTACH_WITHIN_S)
        link.send_message(
            Welcome(
                node_id=join.node_id,
                proof=coordinator_proof(secret, join.nonce),
                certificate=certificate,
            )
        )
        try:
            link.recv(deadline_s=HANDSHAKE_DEADLINE_S)  # the node hangs up and attaches anew
        except (LinkClosed, FrameError):
            pass
        link.close()

    def _attach(self, link: Link, attach: Attach, peer: str) -> None:
        """An enrolled node's control link: its certificate must name the node it says it is."""
        certified = link.peer_id()
        with self._lock:
            pending = (
                self._enrolled.pop(attach.node_id, None) if certified == attach.node_id else None
            )
        if pending is None or pending[1] < time.monotonic():
            self._refuse(
                link,
                peer,
                f"a certificate for {certified or 'no one'!r} attached as node "
                f"{attach.node_id}, which has not just enrolled",
            )
            return
        link.send_message(Attached(node_id=attach.node_id))
        self._enter(pending[0], link, peer)

    def _rejoin(self, link: Link, join: Join, peer: str) -> None:
        """A member coming back under the certificate this mesh's CA gave it (the TLS handshake
        checked it is unexpired): taken back without an invite unless it was removed."""
        certified = link.peer_id()
        reason, final = "", True
        if self.enrollment is None or not certified:
            reason = "a node may only rejoin under its certificate"
        elif certified != join.node_id or certified == COORDINATOR_ID:
            reason = f"a certificate for {certified!r} rejoined as node {join.node_id}"
        elif self.enrollment.is_removed(join.node_id):
            reason = f"node {join.node_id} was removed from this mesh"
        elif join.protocol_version != PROTOCOL_VERSION:
            reason = f"protocol version {join.protocol_version} is not {PROTOCOL_VERSION}"
        elif (
            join.node_id in self.coordinator.nodes or join.node_id in self._enrolled
        ):  # its old link not found lost
            reason, final = f"a node named {join.node_id} has already joined", False
        if reason:
            self._refuse(link, peer, reason, final)
            return
        link.send_message(Attached(node_id=join.node_id))
        log.info("node %s rejoined from %s under its certificate", join.node_id, peer)
        self._enter(join, link, peer)

    def _enter(self, join: Join, link: Link, peer: str) -> None:
        """Make the node a member on its control link; measure it; plan when enough have come."""
        link.limits = MEMBER_LIMITS
        removed = self.enrollment.removed_ids() if self.enrollment is not None else []
        if removed:  # so it refuses their certificates too
            link.send_message(Revoked(node_ids=removed))
        c = self.coordinator
        handle = NodeHandle(
            join, link, inbound=reachable(join.data_host, join.data_port), address=_peer_host(link)
        )
        link.name = f"node {join.node_id}"
        with self._lock:
            self._fragment_tokens[join.node_id] = secrets.token_hex(16)
        c.apply(NodeAdmitted(handle))
        threading.Thread(target=c.read_node, args=(handle,), daemon=True).start()
        handle.measured = measure(link, handle.pongs)
        if not self._believed(handle):
            return
        self._measure_peers(handle)
        c.apply(NodeJoined(join.node_id, peer, not handle.inbound, self.options.nodes_expected))
        c.planning.maybe_plan()

    def _measure_peers(self, handle: NodeHandle) -> None:
        """Have each pair of the joining node and a checked member measure its link, then count
        the node as checked (joins do this in turn, so each pair is measured once)."""
        c = self.coordinator
        with c.peer_links.lock:
            members = [h for h in c.nodes.values() if h.checked and h is not handle]
            for member in members:
                # the end that takes no inbound connection (if either) is dialled through the relay
                target, prober = (member, handle) if not member.inbound else (handle, member)
                try:
                    address, ticket = c.reach(target, prober, probe=True)
                    assert address is not None
                    c.peer_links.ask(prober.node_id, target.node_id)
                    prober.link.send_message(
                        MeasurePeer(
                            peer_node=target.node_id, host=address[0], port=address[1], relay=ticket
                        )
                    )
                except LinkClosed:
                    continue
                c.peer_links.wait(prober.node_id, target.node_id, relayed=bool(ticket))
            handle.checked = True

    def _believed(self, handle: NodeHandle) -> bool:
        """Time a product on the joining node against the speed it claimed; a node that cannot
        answer it rightly is dropped."""
        rtt = handle.measured.latency_s * 2 if handle.measured else 0.0
        handle.speed_check = SpeedCheck(handle.link, handle.join.resources.bytes_per_second, rtt)
        handle.proven_rate = handle.speed_check.run()
        if handle.proven_rate is not None:
            return True
        log.warning("dropped node %s: it did not answer the speed probe rightly", handle.node_id)
        handle.link.close()
        return False

    def _refusal(self, join: object, nonce: str) -> tuple[str, str]:
        """Why this join is refused ("" if it is not), and the secret of the invite it spent."""
        if not isinstance(join, Join):
            return f"expected a join message, got {type(join).__name__}", ""
        if join.protocol_version != PROTOCOL_VERSION:
            return f"protocol version {join.protocol_version} is not {PROTOCOL_VERSION}", ""
        if join.node_id in self.coordinator.nodes or join.node_id in self._enrolled:
            return f"a node named {join.node_id} has already joined", ""
        reason = self.enrollment.refusal(join) if self.enrollment is not None else ""
        invites = self.coordinator.invites
        return (
            (reason, "")
            if reason
            else invites.claim(join.invite_id, nonce, join.proof, join.node_id)
        )

    def _certify(self, join: object) -> str | None:
        """The joining node's certificate ("" on a plaintext mesh; None if its request is bad)."""
        if self.enrollment is None:
            return ""
        assert isinstance(join, Join)
        try:
            return self.enrollment.certify(join.node_id, join.csr)
        except IdentityError as exc:
            log.warning("node %s: %s", join.node_id, exc)
            return None

    def renew(self, handle: NodeHandle, renew: Renew) -> None:
        if self.enrollment is None:
            return
        try:
            handle.link.send_message(
                Certificate(certificate=self.enrollment.certify(handle.node_id, renew.csr))
            )
            log.info("renewed node %s's certificate", handle.node_id)
        except IdentityError as exc:
            log.warning("no renewal for node %s: %s", handle.node_id, exc)
        except LinkClosed:
            pass

    def remove_node(self, node_id: str) -> bool:
        """Eject a member: no certificate for its id from now on, the invite it joined with
        revoked (whoever holds it could join as a new node), every member told to refuse its
        certificate at once, its control link dropped (the plan is made again without it).
        False if no such member is joined (or the id names none)."""
        if node_id_refusal(node_id):
            return False
        if self.enrollment is not None:
            self.enrollment.remove(node_id)
        c = self.coordinator
        c.apply(NodeRemoved(node_id, tuple(c.invites.revoke_for(node_id))))
        handle = c.nodes.get(node_id)
        with self._lock:
            self._fragment_tokens.pop(node_id, None)
            self._enrolled.pop(node_id, None)  # enrolled, not yet attached: it attaches no more
        if handle is not None:
            handle.link.close()
            c.lose(handle, "removed by the administrator", observed=False)
        if c.fragment_gate is not None:
            c.fragment_gate.drop()
        self._tell_revoked(list(c.nodes.values()), node_id)
        return handle is not None

    def _tell_revoked(self, members: list[NodeHandle], node_id: str) -> None:
        """Every removed node, to ``members``, each followed by a ping: a member applies the list
        before it answers, so once this returns every member that answered refuses them."""
        removed = Revoked(
            node_ids=self.enrollment.removed_ids() if self.enrollment is not None else [node_id]
        )
        asked = []
        for member in members:
            nonce = secrets.randbits(62)
            member.pongs.expect(nonce)
            try:
                member.link.send_message(removed)
                member.link.send_message(Ping(nonce=nonce))
                asked.append((member, nonce))
            except LinkClosed:
                pass  # its reader finds the link closed; it is told again when it rejoins
        deadline = time.monotonic() + REVOKED_ANSWER_S
        silent = [
            m.node_id
            for m, nonce in asked
            if m.pongs.wait(nonce, max(0.0, deadline - time.monotonic())) is None
        ]
        if silent:
            log.warning(
                "members %s did not confirm within %.0f s that they refuse node %s",
                ", ".join(silent),
                REVOKED_ANSWER_S,
                node_id,
            )

    def fragment_token(self, node_id: str) -> str:
        return self._fragment_tokens.get(node_id, "")

    def fragment_allowed(self, token: str | None, fragment: FragmentEntry) -> bool:
        """A private mesh serves its ends' fragments (the embedding, the head, the tokenizer) to
        the coordinator's own node alone: with them a member could read the hidden states it
        receives."""
        if not self.options.private or fragment.kind not in PRIVATE_KINDS:
            return True
        own = self._fragment_tokens.get(self.coordinator.own_node(), "")
        return bool(own) and hmac.compare_digest((token or "").encode(), own.encode())

    def fragment_token_ok(self, token: str | None) -> bool:
        """Whether ``token`` is a joined member's fragment token (compared in constant time)."""
        with self._lock:
            tokens = [self._fragment_tokens.get(node_id, "") for node_id in self.coordinator.nodes]
        given = (token or "").encode()
        return bool(token) and any(hmac.compare_digest(given, t.encode()) for t in tokens if t)
