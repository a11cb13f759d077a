"""The coordinator: membership, planning, start-up order and the route; no model compute.

Nodes join over the control port (``joining.Joining``: an invite proved, a certificate
issued, the node's link and speed measured). Once ``nodes_expected`` have joined, the planner
(``planning.Planning``) assigns layer ranges; stages are assigned and loaded all at once
(``startup.StartUp``), each reports READY with a descriptor checked against the plan, then the
links are made downstream first and stage 0's route is published last. Only then is the mesh
ready. A node that leaves fails the requests in flight and triggers a re-plan over the nodes
that remain. Every change of the mesh's state is an event applied by ``mesh_state.apply``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from seamline.config import ModelConfig
from seamline.errors import RequestError
from seamline.mesh.control.back_off import BackOff
from seamline.mesh.control.balance import Balance
from seamline.mesh.control.enrollment import Enrollment
from seamline.mesh.control.events import EventFeed
from seamline.mesh.control.frame_proofs import ProofDesk
from seamline.mesh.control.invites import InviteBook
from seamline.mesh.control.joining import Joining
from seamline.mesh.control.member_gate import Opened, Refusals, drawer, may_end, serves
from seamline.mesh.control.mesh_state import (
    Event,
    MeshState,
    NodeLost,
    NodeReported,
    Replanning,
    ShuttingDown,
)
from seamline.mesh.control.mesh_status import describe
from seamline.mesh.control.node_handle import NodeHandle
from seamline.mesh.control.peer_links import PeerLinks
from seamline.mesh.control.planning import Planning
from seamline.mesh.control.reference import Reference
from seamline.mesh.control.relay import Relay
from seamline.mesh.control.serving_pace import ServingPace
from seamline.mesh.control.startup import StartUp, StartupError, Superseded, choose_transport
from seamline.mesh.control.state_keeper import StateKeeper
from seamline.mesh.control.verify import Verifier
from seamline.mesh.identity import MeshAuthority
from seamline.mesh.plan.types import ModelSpec, Plan
from seamline.mesh.protocol.fragment_server import PeerGate
from seamline.mesh.protocol.frame_signing import public_key_of
from seamline.net.frames import LIMITS, FrameError, FrameType, TokenFrame, TokenRow
from seamline.net.link import LinkClosed
from seamline.net.messages import (
    Close,
    Digests,
    Failure,
    FrameProof,
    FrameProofPart,
    KeptRows,
    Linked,
    Loading,
    Message,
    Open,
    PeerLink,
    Pong,
    ProbeResult,
    Prompt,
    Ready,
    RelayAccept,
    Renew,
    SpeedReady,
    SpeedSums,
    Stats,
    StatsRequest,
    encode_message,
)
from seamline.runtime.grammar import package_masks

log = logging.getLogger("seamline.coordinator")
BACK_OFF_LOOK_AGAIN_S = 5.0  # a back-off that ended while a plan started up: looked at again


@dataclass
class CoordinatorOptions:
    nodes_expected: int = 1
    dtype: str = "float32"
    int8_activations: bool = (
        False  # every stage's quantized matmuls on int8 blocks (``seamline.precision``)
    )
    precision: str = (
        "exact"  # the name of the precision ``dtype`` and ``int8_activations`` come from
    )
    rows_alone: bool = False  # every stage's int8 rows computed as alone (``Precision.rows_alone``)
    context_length: int = 4096
    fragments_url: str = ""
    fragments_certificate: str = ""  # PEM, when the API (and so the fragments) is served over HTTPS
    locked_plan: Plan | None = None
    model_config: ModelConfig | None = None  # needed to form lockstep groups
    tensor_parallel: int = 0  # ranks per stage; 0: one node per stage unless a group is needed
    transport: str = "tcp"  # lockstep groups' Comm: auto | tcp | torch
    gate_timeout_s: float = 30.0
    insecure_comm: bool = False  # torch.distributed may run between hosts (it encrypts nothing)
    micro_batches: int = (
        0  # in flight in the pipeline (0: one per stage; fewer than the stages are not taken)
    )
    live_growth: bool = (
        True  # a node joining a serving mesh is planned in when it raises throughput enough
    )
    rebalance: bool = (
        True  # stages that measure apart from the plan under load are re-planned (``balance``)
    )
    kv_cache_bytes: int = 0  # stage 0's KV budget (0: most of its free memory)
    heartbeat_timeout_s: float = 3.0  # a member silent this long is lost
    state_dir: Path | None = None  # removed members are kept here
    package_dir: Path | None = (
        None  # the packaged model: stages are checked against it (None: unchecked)
    )
    verify_fraction: float = 0.0  # of requests followed through the coordinator's copy (``verify``)
    verify_node: str | None = None  # tests: followed requests check its stage (``verify``)
    private: bool = False  # the route's ends on the coordinator's own node: members see no token (``plan.private``)
    own_invite: str = ""  # the invite made for the coordinator's own node alone
    speculation: str = (
        "auto"  # stage 0 drafts windows (``runtime/speculation.py``) where the route allows
    )
    draft_max: int = 8


TokenSink = Callable[[list[TokenRow]], None]
FailureSink = Callable[[int | None, str, str], None]  # request (None: all), reason, blame


class Coordinator:
    """The mesh's state (``state_keeper``) and what reads and changes it, composed of its
    joining (``joining.Joining``), its planning (``planning.Planning``) and the start-up of each
    plan (``startup.StartUp``)."""

    def __init__(
        self,
        invites: InviteBook,
        model: ModelSpec,
        model_hash: str,
        options: CoordinatorOptions,
        authority: MeshAuthority | None = None,
    ) -> None:
        """``invites``: who may join; ``authority``: the mesh CA, whose certificates every link
        presents (None: plaintext links, for measuring what TLS costs)."""
        self.invites = invites
        self.invite = invites.where
        removed = options.state_dir / "removed.json" if options.state_dir else None
        self.enrollment = (
            Enrollment(authority, removed_file=removed) if authority is not None else None
        )
        self.model = model
        self.model_hash = model_hash
        self.options = options
        self.keeper = StateKeeper()
        self.feed = EventFeed()  # the console's
        self.keeper.listen(self.feed)
        self.lock = threading.RLock()  # held while a decision is taken on the state it reads
        self.on_tokens: TokenSink = lambda rows: None
        self.on_failure: FailureSink = lambda request, reason, blame: None
        self.in_flight: Callable[[int], bool] = lambda request: (
            False
        )  # the backend's: a client waits on it
        self.refusals = Refusals()  # what members sent that was not theirs to say
        self.opened = Opened()  # what a stage may call invalid in the requests in flight
        self.fragment_gate: PeerGate | None = None  # the fragment port's, over TLS (``serve.Mesh``)
        reference = (
            Reference(options.package_dir, options.dtype, options.rows_alone)
            if options.package_dir
            else None
        )
        self.relay = Relay()
        self.peer_links = PeerLinks()
        self.back_off = BackOff(self._back_off_over)  # members that failed wait to be planned
        self.joining = Joining(self)
        self.planning = Planning(self)
        self.balance = Balance(self)
        self.serving_pace = ServingPace(self)
        self.startup = StartUp(self)
        self.verifier = Verifier(
            reference,
            options.verify_fraction,
            lambda rows: self.on_tokens(rows),
            self.startup.expel,
            masks=package_masks(options.package_dir),
            public_keys=self.public_keys,
            ask=self._tell,
            choice=options.verify_node,
        )
        self.proofs = ProofDesk(  # members' proofs that a sender lied
            self.verifier, self.public_keys, self.refusals.refuse, self.startup.expel
        )

    # -- the state: read here, changed only by ``apply`` ---------------------------------
    def apply(self, event: Event) -> MeshState:
        """Apply ``event`` to the mesh's state (``mesh_state.apply``, on the keeper's thread)."""
        return self.keeper.apply(event)

    @property
    def nodes(self) -> Mapping[str, NodeHandle]:
        return self.keeper.current.nodes

    @property
    def plan(self) -> Plan | None:
        return self.keeper.current.plan

    @property
    def plan_id(self) -> int:
        return self.keeper.current.plan_id

    @property
    def state(self) -> str:
        """What the mesh is doing, in words (/api/status's ``state``)."""
        return self.keeper.current.phase

    @property
    def ready(self) -> threading.Event:
        """Set while the current plan's route serves."""
        return self.keeper.ready

    @property
    def link_key(self) -> str:
        return self.startup.link_key

    def start(self, host: str) -> int:
        """Listen for nodes on the control port (``joining``); the port."""
        if self.options.rebalance and self.options.locked_plan is None:  # a locked plan is pinned
            self.balance.start()
            self.serving_pace.start()
        return self.joining.start(host)

    def _tell(self, node_id: str, message: Message) -> None:
        """A message to a member, if it is still here (one lost meanwhile is news elsewhere)."""
        handle = self.nodes.get(node_id)
        if handle is not None:
            with contextlib.suppress(LinkClosed):
                handle.link.send_message(message)

    def public_keys(self, node_id: str) -> list[Any]:
        """The keys of a member's certificates, which sign its frames (``frame_signing``): those
        certified here, and its control link's (one certified before a restart); none in a
        plaintext mesh."""
        keys = self.enrollment.keys_of(node_id) if self.enrollment is not None else []
        handle = self.nodes.get(node_id)
        read = getattr(handle.link.sock, "peer_certificate_der", None) if handle else None
        live = public_key_of(read()) if read is not None else None
        return keys + [live] if live is not None and live not in keys else keys

    def remove_node(self, node_id: str) -> bool:
        return self.joining.remove_node(node_id)

    # -- membership (joining: ``joining.Joining``) --------------------------------------
    def read_node(self, handle: NodeHandle) -> None:
        while True:
            try:
                message = handle.link.recv()
            except (LinkClosed, FrameError) as exc:
                self._lost(handle, str(exc))
                handle.link.close()  # a frame it may not send (or a broken one): nothing more is read from it
                return
            handle.last_heard = time.monotonic()
            self._on_message(handle, message)

    def _on_message(self, handle: NodeHandle, message: object) -> None:
        """One message a member sent on its control link."""
        if isinstance(message, TokenFrame):
            self._take_tokens(handle, message)
        elif isinstance(message, (Ready, Linked)):
            self._started(handle, message)
        elif isinstance(message, Loading):
            handle.loading = message if message.plan_id == self.plan_id else None
        elif isinstance(message, Stats):
            handle.update(stats=message)
        elif isinstance(message, ProbeResult):
            handle.update(probe_result=message)
        elif isinstance(message, Failure):
            self._reported(handle, message)
        elif isinstance(message, Renew):
            self.joining.renew(handle, message)
        elif (
            isinstance(message, Pong)
            and not handle.beats.answered(message.nonce)
            and not handle.pongs.arrived(message.nonce)
        ):
            log.warning(
                "refused node %s's pong %d: no such ping is waiting", handle.node_id, message.nonce
            )
        elif isinstance(message, PeerLink) and not self.peer_links.report(handle.node_id, message):
            log.warning(
                "ignored node %s's link report on %s: it was not asked",
                handle.node_id,
                message.peer_node,
            )
        elif isinstance(message, (SpeedReady, SpeedSums)) and handle.speed_check is not None:
            handle.speed_check.answer(message)
        elif isinstance(message, Digests):
            self.verifier.digests(handle.node_id, message)
        elif isinstance(message, KeptRows):
            self.verifier.kept_rows(handle.node_id, message)
        elif isinstance(message, (FrameProof, FrameProofPart)):
            self.proofs.take(handle.node_id, message)

    def _started(self, handle: NodeHandle, message: Ready | Linked) -> None:
        """A stage's start-up went on: loaded (Ready) or linked downstream (Linked)."""
        plan_id = message.descriptor.plan_id if isinstance(message, Ready) else message.plan_id
        if plan_id != self.plan_id:  # a start-up a newer plan replaced
            log.info(
                "ignored node %s's %s for plan %d: plan %d is current",
                handle.node_id,
                message.kind,
                plan_id,
                self.plan_id,
            )
        elif isinstance(message, Ready):
            handle.update(ready=message, loading=None)
        else:
            handle.update(linked=True)

    def _take_tokens(self, handle: NodeHandle, frame: TokenFrame) -> None:
        """Tokens go to their clients only from the node that draws them on the current plan,
        and only for requests in flight (a member's control link could name any request)."""
        plan = self.plan  # read once, without the lock a re-plan holds while it plans
        if handle.node_id != drawer(plan) or self.nodes.get(handle.node_id) is not handle:
            self.refusals.refuse(
                handle.node_id,
                "TOKEN frame: it does not draw the current plan's tokens",
                len(frame.rows),
            )
            return
        rows = [row for row in frame.rows if self.in_flight(row.request)]
        if len(rows) < len(frame.rows):  # a client that went away leaves a few of these
            self.refusals.refuse(
                handle.node_id,
                "tokens for requests not in flight",
                len(frame.rows) - len(rows),
                logging.INFO,
            )
        if rows:
            self.opened.drew([row.request for row in rows])
            self.verifier.tokens(rows)  # held until checked, for a request the coordinator follows

    def _reported(self, handle: NodeHandle, message: Failure) -> None:
        """A node's failure report: its own start-up, or a request it serves. A node outside the
        plan serves no request, so its reports end none; only stage 0 and the drawing stage may
        end one for the request's own fault or the load (``member_gate``). Any stage that says its
        stage failed, these two included, is taken at its word while the mesh serves: it is taken
        for lost and the requests replay without it (a member that says so of every request only
        drops itself); while it re-plans, stages' links break as they are replaced, and such a
        report is no news."""
        self.apply(NodeReported(handle.node_id, message.reason))  # one line: ``messages.Reason``
        if message.plan_id is not None:
            self._group_broke(handle, message)
            return
        if message.request is None:
            with handle.changed:
                if (
                    message.room_bytes is not None
                ):  # it claimed more room than it has: planned with what it has
                    handle.memory_cap = min(
                        message.room_bytes, handle.memory_cap or message.room_bytes
                    )
                handle.failure = message.reason
                handle.changed.notify_all()
            return
        plan = self.plan
        if not serves(plan, handle.node_id):
            log.warning("ignored node %s's report on a request: it serves no stage", handle.node_id)
            return
        if message.blame == "frame":  # it refused the request's frame: the attempt is over now
            if self.in_flight(message.request):
                reason = f"node {handle.node_id} refused its frame: {message.reason}"
                self.on_failure(message.request, reason, "replanned")  # it replays at once
            return
        ends = may_end(plan, handle.node_id)
        if message.blame != "node" and not (ends and self.in_flight(message.request)):
            self.refusals.refuse(
                handle.node_id,
                f"a report ending a request ({message.blame}): it is not stage 0 "
                "or the drawing stage, or the request is not in flight",
            )
            return
        validated = message.blame == "request" and not self.opened.may_be_invalid(
            plan, handle.node_id, message.request
        )
        if message.blame == "node" or validated:  # a validated request: the stage failed, not it
            if (
                not self.ready.is_set()
            ):  # the route is being replaced: links break as stages go; nothing to replay
                log.info(
                    "ignored node %s's report that its stage failed: the mesh is re-planning",
                    handle.node_id,
                )
                return
            said = (
                "a request it was sent, validated, is invalid" if validated else "its stage failed"
            )
            self.lose(handle, f"it reports {said}: {message.reason}", observed=False)
            return
        self.on_failure(message.request, message.reason, message.blame)

    def _group_broke(self, handle: NodeHandle, message: Failure) -> None:
        """The lockstep group ``handle`` serves in broke (a gate timed out or its link closed):
        the rank at fault is taken for lost, or, with none named, the group is formed again.
        Either way its requests replay. A report on an older plan, or naming a node outside
        the reporter's group, changes nothing."""
        with self.lock:
            current = (
                self.plan is not None
                and message.plan_id == self.plan_id
                and self.nodes.get(handle.node_id) is handle
            )
            group = (
                next((s.members() for s in self.plan.stages if handle.node_id in s.members()), ())
                if current
                else ()
            )
            suspect = self.nodes.get(message.suspect) if message.suspect in group else None
        if not group or (message.suspect is not None and message.suspect not in group):
            log.warning(
                "ignored node %s's report on plan %s's group (plan %d is current; it blames %s)",
                handle.node_id,
                message.plan_id,
                self.plan_id,
                message.suspect,
            )
        elif message.suspect is None or message.suspect == handle.node_id:
            with self.lock:
                if message.plan_id != self.plan_id:
                    return  # an earlier report on the same break re-planned already
                self._replan(f"the lockstep group of {handle.node_id} broke", message.reason)
        elif suspect is not None:
            self.lose(suspect, f"its lockstep group lost it: {message.reason}")

    def lose(self, handle: NodeHandle, reason: str, observed: bool = True) -> None:
        """Take a member for lost: its links close, its requests replay. ``observed``: the
        coordinator saw it fail (a closed link, missed beats), not only its word, which counts
        against the requests it was starting (``mesh_backend.Implicated``)."""
        self._lost(handle, reason, observed)
        handle.link.close()

    def shut_down(self) -> None:
        """The mesh is being stopped on purpose: nodes that leave now are not planned around."""
        self.balance.stop()
        self.serving_pace.stop()
        self.apply(ShuttingDown())

    def _lost(self, handle: NodeHandle, reason: str, observed: bool = True) -> None:
        with self.lock:
            if self.nodes.get(handle.node_id) is not handle:
                return
            self.peer_links.forget(handle.node_id)
            plan = self.plan
            state = self.apply(NodeLost(handle.node_id, reason))
        handle.update()
        if state.closing:
            return
        if plan is not None and any(handle.node_id in s.members() for s in plan.stages):
            self.back_off.strike(handle.node_id, reason)
            self._replan(f"node {handle.node_id} left the mesh", reason, observed)
        elif plan is None:  # no plan could be made: perhaps one can without this node
            self.planning.maybe_plan()

    def _back_off_over(self) -> None:
        """A member's back-off ended: plan it in, when the mesh is worth changing for it (while a
        plan starts up, once it serves)."""
        state = self.keeper.current
        if state.plan is not None and not state.ready and not state.closing:
            timer = threading.Timer(BACK_OFF_LOOK_AGAIN_S, self._back_off_over)
            timer.daemon = True
            timer.start()
        elif not state.closing:
            self.planning.maybe_plan()

    def _replan(self, event: str, detail: str, observed: bool = True) -> None:
        """The plan serves no more (``event``): plan again; requests in flight replay on the next."""
        self.apply(Replanning(event))
        self.on_failure(
            None, f"{event} mid-request ({detail})", "lost" if observed else "replanned"
        )
        self.planning.maybe_plan(force=True)

    def own_node(self) -> str:
        """The coordinator's own node: the one that joined with the invite made for it alone
        ("" until it has); a private mesh's ends are its."""
        own = [
            h.node_id
            for h in self.nodes.values()
            if self.options.own_invite and h.join.invite_id == self.options.own_invite
        ]
        return own[0] if own else ""

    def reach(
        self, target: NodeHandle | None, dialler: NodeHandle, probe: bool = False
    ) -> tuple[tuple[str, int] | None, str]:
        """Where ``dialler`` dials ``target``'s data port, and the relay ticket when it must go
        through the relay (``target`` takes no inbound connection and is told to dial out too).
        ``probe``: the link only measures the pair (``peer_links``)."""
        if target is None:
            return None, ""
        if target.inbound:
            return (target.join.data_host, target.join.data_port), ""
        ticket = self.relay.ticket(probe)
        target.link.send_message(RelayAccept(ticket=ticket, peer_node=dialler.node_id, probe=probe))
        return (self.invite.hosts[0], self.invite.control_port), ticket

    def wait_for(
        self, handle: NodeHandle, value: Callable[[], object], what: str, timeout_s: float
    ) -> Any:
        """``value()`` once it is not None: what ``handle``'s reader set; StartupError when the
        node reports a failure, leaves, or sends nothing within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with handle.changed:
            while (got := value()) is None:
                if handle.failure is not None:
                    raise StartupError(f"node {handle.node_id}: {handle.failure}")
                if handle.node_id not in self.nodes:
                    raise StartupError(f"node {handle.node_id} left before {what}")
                if not handle.changed.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise StartupError(
                        f"node {handle.node_id} sent no {what} within {timeout_s:.0f} s"
                    )
        return got

    # -- requests -----------------------------------------------------------------------
    def pipeline(self) -> list[NodeHandle]:
        with self.lock:
            state = (
                self.keeper.current
            )  # one snapshot: a node lost leaves its plan until the re-plan
            if state.plan is None or not self.ready.is_set():
                raise StartupError(f"the mesh is not ready: {state.phase}")
            gone = [s.node_id for s in state.plan.stages if s.node_id not in state.nodes]
            if gone:
                raise StartupError(f"the mesh is not ready: node {', '.join(gone)} left")
            return [state.nodes[s.node_id] for s in state.plan.stages]

    def open_request(self, open_msg: Open, tokens: list[int]) -> None:
        """Stage 0 opens the session and passes it down the pipeline ahead of the frames; the
        prompt follows in chunks. An Open larger than a node takes is the request's fault."""
        size = len(encode_message(open_msg))
        if size > LIMITS[FrameType.CONTROL]:
            raise RequestError(
                f"the request's sampling parameters take {size} bytes, more than the "
                f"{LIMITS[FrameType.CONTROL]} a node takes in one message"
            )
        stage0 = self.pipeline()[0]
        self.verifier.opened(open_msg, tokens)
        self.opened.opened(open_msg.request, bool(open_msg.sampling.grammar))
        stage0.link.send_message(open_msg)
        for chunk in Prompt.chunks(open_msg.request, tokens):
            stage0.link.send_message(chunk)

    def close_request(self, request: int) -> None:
        """Stage 0 frees the request and tells the later stages, in order with its frames."""
        self.verifier.closed(request)
        self.opened.closed(request)
        try:
            stage0 = self.pipeline()[0]
        except StartupError:
            return
        try:
            stage0.link.send_message(Close(request=request))
        except LinkClosed:
            pass

    def stage_stats(self, timeout_s: float = 10.0) -> list[Stats]:
        """Fresh counters from every stage of the pipeline, in pipeline order."""
        handles = self.pipeline()
        for handle in handles:
            handle.update(stats=None)
            handle.link.send_message(StatsRequest())
        return [self.wait_for(h, lambda h=h: h.stats, "STATS", timeout_s) for h in handles]  # type: ignore[misc]

    def status(self) -> dict[str, object]:
        """What /api/status shows (``mesh_status``), with the console's feed."""
        return describe(self)


__all__ = [
    "Coordinator",
    "CoordinatorOptions",
    "StartupError",
    "Superseded",
    "choose_transport",
    "Message",
]
