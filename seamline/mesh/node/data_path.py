"""A node's data path: the links of its plan's route (dialled on ``Route``, taken on its data
port after the challenge of ``data_links``), and the frames that come on them, each handed to
the stage its link's role feeds; ``Node`` takes these methods."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from seamline.mesh.node.checks import frame_proof
from seamline.mesh.node.data_links import PROBE, UPSTREAM, LinkRefused, admit, dial, expected_from
from seamline.mesh.node.peer_probe import ProbeRefused, answer_probe
from seamline.mesh.protocol import frame_signing
from seamline.mesh.protocol.frame_signing import Signed
from seamline.mesh.protocol.relay_wire import PAIR_WAIT_S, RELAY_MAGIC
from seamline.net.frames import FrameError, HiddenFrame, TokenFrame
from seamline.net.link import Link, LinkClosed, tune
from seamline.net.messages import (
    Close,
    Failure,
    Forget,
    Fork,
    Linked,
    Message,
    Open,
    RelayAccept,
    Route,
)
from seamline.net.overlap import ReadAhead, SendBehind
from seamline.net.tls import TlsRefused, TlsSocket
from seamline.runtime.speculation import Speculation
from seamline.runtime.stage_worker import RowKeys

if TYPE_CHECKING:
    from seamline.mesh.node.process import Node

log = logging.getLogger("seamline.node")


class DataPath:
    """The route's links and frames; mixed into ``Node``."""

    def _route(self: Node, route: Route) -> None:
        assert self.worker is not None and self.control is not None
        self.worker.stages = max(1, route.stages)
        for stage in (self.worker, self.tail):
            if stage is not None:
                stage.links.refused = self._frame_refused
        self.worker.micro_batches = max(1, route.stages, route.micro_batches)
        if self.worker.head is not None:
            self.worker.head.share_prefixes(route.forks)
            speculation = Speculation(
                route.speculation, route.draft_max
            )  # mtp: the last stage's layer drafts
            self.worker.head.speculate(
                speculation.for_model(True) if speculation.mode == "mtp" else speculation
            )
        assert self.assignment is not None
        tls = self.credentials.client if self.credentials else None
        if route.downstream is not None:
            link = dial(
                route.downstream,
                route.downstream_node,
                self.options.node_id,
                self.assignment,
                tls,
                route.downstream_relay,
            )
            self._keep(link)
            self._data_links[route.downstream_node or "downstream"] = link
            sender = SendBehind(
                link, self._send_failed
            )  # a prompt's chunk leaves while the next is computed
            self.worker.links.downstream = sender.send_hidden
            self.worker.links.downstream_message = sender.send_message
        if route.stage0 is not None:
            link = dial(
                route.stage0,
                route.stage0_node,
                self.options.node_id,
                self.assignment,
                tls,
                route.stage0_relay,
            )
            self._keep(link)
            self._data_links[route.stage0_node or "stage0"] = link
            self.worker.links.stage0 = link.send_tokens
        self.control.send_message(Linked(plan_id=route.plan_id))

    def _accept_relayed(self: Node, accept: RelayAccept) -> None:
        """This node takes no inbound connection: dial the coordinator's relay with the ticket and
        serve the data link that comes through it (TLS end to end, this node as the server)."""
        assert self.control is not None
        host = self.control.sock.getpeername()[0]
        try:
            sock = tune(
                socket.create_connection((host, self.invite.control_port), timeout=PAIR_WAIT_S)
            )
            sock.sendall(RELAY_MAGIC + accept.ticket.encode())
            context = self._server_context()
            channel = (
                TlsSocket.handshake(sock, context, True, PAIR_WAIT_S)
                if context is not None
                else sock
            )
        except (OSError, TlsRefused) as exc:
            log.error("relayed link from %s failed: %s", accept.peer_node, exc)
            if not accept.probe:  # a probe that fails only leaves the pair unmeasured
                self._report(None, f"the relayed link from {accept.peer_node} failed: {exc}")
            return
        self._read_data(Link(channel, name=f"relayed data from {accept.peer_node}"))

    def _read_data(self: Node, link: Link) -> None:
        peer = link.peer()
        assignment = self.assignment
        try:
            role = admit(
                link, assignment, certified=self.credentials is not None, revoked=self.revoked
            )
            if role == PROBE:
                answer_probe(link)
                return
        except (LinkRefused, ProbeRefused, LinkClosed, FrameError) as exc:
            log.warning("refused data link from %s: %s", peer, exc)
            link.close()
            return
        self._keep(link)
        try:
            self._read_frames(link, peer, role, assignment)
        finally:  # a link whose reader ended is done with: its descriptor and buffers go now
            link.close()
            self._unkeep(link)

    def _send_failed(self: Node, requests: list[int], exc: Exception) -> None:
        """The downstream link broke with these requests' frames queued on it."""
        for request in requests:
            reason = f"layers [{self._layers()}) could not send downstream: {self._explain(exc)}"
            self._report(request, reason, cause=exc)

    def _frame_refused(self: Node, request: int, why: str) -> None:
        """A row of ``request`` was refused here: the coordinator fails the request's attempt at
        once and replays it, rather than leave it waiting for a token that will not come."""
        if self.control is None:
            return
        try:
            reason = f"layers [{self._layers()}) {why}"
            self.control.send_message(Failure(request=request, reason=reason, blame="frame"))
        except LinkClosed:
            pass

    def _read_frames(self: Node, link: Link, peer: str, role: str, assignment: object) -> None:
        """The link's frames, each run on this thread (the stage's compute thread), in order; the
        next ones are read meanwhile while it runs a large one (``ReadAhead``)."""
        frames = ReadAhead(link)
        fed = (
            self.tail or self.worker
        )  # the stage this link's frames feed: it idles while it waits for them
        idle = fed.idle if role == UPSTREAM and fed is not None else None
        signed = SignedFrames(link)
        while True:
            try:
                if idle is not None:
                    idle.wait()
                frame = frames.recv()
                if idle is not None:
                    idle.work()
            except LinkClosed:
                return
            except FrameError as exc:
                log.warning("closing data link from %s: %s", peer, exc)
                return
            if self.assignment is not assignment:  # a newer plan: this link's route is gone
                log.warning(
                    "closing data link from %s: its plan was replaced; its frames refused", peer
                )
                return
            if isinstance(frame, HiddenFrame) and self._checks_signatures(fed):
                refusal = signed.refusal(frame, fed.digest_seed)
                if refusal.why:
                    self._refuse_unsigned(frame, peer, refusal.why)
                    if refusal.shown_row is not None:
                        self._show_lie(frame, signed.sender, refusal.shown_row)
                    continue
            try:
                self._on_frame(frame, peer, role)
            except Exception as exc:  # one bad frame never stops the node; its requests fail
                log.exception("frame from %s failed", peer)
                for request in {row.request for row in getattr(frame, "rows", ())}:
                    self._report(
                        request,
                        f"layers [{self._layers()}) failed: {self._explain(exc)}",
                        cause=exc,
                    )

    def _checks_signatures(self: Node, fed: object) -> bool:
        """Whether frames to ``fed`` must be signed: the plan checks its stages, over TLS."""
        return self.credentials is not None and bool(getattr(fed, "digest_seed", 0))

    def _refuse_unsigned(self: Node, frame: HiddenFrame, peer: str, refusal: str) -> None:
        """A frame whose signature does not hold: nothing is computed from it; its requests
        fail here at once, and replay."""
        log.warning("refused a frame from %s: %s", peer, refusal)
        for request in {row.request for row in frame.rows}:
            self._frame_refused(request, f"refused a frame from {peer}: {refusal}")

    def _show_lie(self: Node, frame: HiddenFrame, sender: str, index: int) -> None:
        """Show the coordinator the row whose bytes ``sender`` signed with another digest: on a
        thread of its own (its parts may be many), one proof at a time (the first removes it)."""
        assignment = self.assignment
        if assignment is None or not self._showing.acquire(blocking=False):
            return
        proof = frame_proof(assignment.plan_id, sender, frame, index)
        if not proof:
            log.warning("the refused row from %s is too large to show the coordinator", sender)
        threading.Thread(target=self._send_proof, args=(proof,), daemon=True).start()

    def _send_proof(self: Node, proof: list[Message]) -> None:
        try:
            for message in proof:
                if self.control is not None:
                    self.control.send_message(message)
        except LinkClosed:
            pass
        finally:
            self._showing.release()

    def _signer(
        self: Node, seed: int
    ) -> Callable[[RowKeys, torch.Tensor, torch.Tensor], Signed] | None:
        """What signs this node's frames under the plan's ``seed`` (None without a certificate)."""
        if self.credentials is None:
            return None
        key, sender = self.credentials.signing_key(), self.options.node_id
        return lambda rows, digests, tensor: frame_signing.sign(
            key, seed, sender, rows, digests, tensor
        )

    def _keep(self: Node, link: Link) -> None:
        with self._peers_lock:
            self.peers.append(link)

    def _unkeep(self: Node, link: Link) -> None:
        with self._peers_lock:
            if link in self.peers:
                self.peers.remove(link)

    def _drop_data_links(self: Node) -> None:
        with self._peers_lock:
            peers, self.peers = self.peers, []
            self._data_links = {}
        for link in peers:
            link.close()

    def _on_frame(self: Node, frame: object, peer: str, role: str) -> None:
        worker = self.tail or self.worker  # a private mesh's node takes frames as its last stage
        if worker is None:
            log.warning("frame from %s before this node was loaded; refused", peer)
            return
        if not expected_from(frame, role):
            worker.refused += 1
            log.warning(
                "refused %s from %s: its %s link does not carry it",
                type(frame).__name__,
                peer,
                role,
            )
            return
        if isinstance(frame, Open) and not worker.is_first:
            worker.open(frame)
        elif isinstance(frame, (Fork, Forget)) and not worker.is_first:
            worker.lifetime(frame)
        elif isinstance(frame, Close) and not worker.is_first:
            worker.close(frame)
        elif isinstance(frame, HiddenFrame) and not worker.is_first:
            worker.hidden(frame)
        elif isinstance(frame, TokenFrame) and worker.is_first:
            worker.tokens(frame)
        else:
            worker.refused += 1
            log.warning(
                "refused %s from %s: not expected by this stage", type(frame).__name__, peer
            )


class SignedFrames:
    """The signature checks of one data link's frames: its peer's certificate, read once."""

    def __init__(self, link: Link) -> None:
        self.sender = link.peer_id()
        certificate = getattr(link.sock, "peer_certificate_der", lambda: None)()
        self.key = frame_signing.public_key_of(certificate)

    def refusal(self, frame: HiddenFrame, seed: int) -> frame_signing.Refusal:
        """Why ``frame`` is refused ("" when its sender signed what it holds)."""
        rows = [(r.request, r.position, r.count) for r in frame.rows]
        signed = frame_signing.Signed(*frame.signed) if frame.signed is not None else None
        return frame_signing.frame_refusal(self.key, seed, self.sender, rows, frame.tensor, signed)
