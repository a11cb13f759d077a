"""The coordinator: membership, planning, start-up order and the route; no model compute.

Nodes join over the control port (``joining.Membership``: an invite proved, a certificate
issued, the node's link and speed measured). Once ``nodes_expected`` have joined, the planner assigns layer ranges; stages are assigned and
loaded downstream first, each reports READY with a descriptor checked against the plan, then
the links are made downstream first and stage 0's route is published last. Only then is the
mesh ready. A node that leaves fails the requests in flight and triggers a re-plan over the
nodes that remain.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from pathlib import Path
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from seamline.config import ModelConfig
from seamline.errors import RequestError, SeamlineError
from seamline.mesh.control.enrollment import Enrollment
from seamline.mesh.control.fragment_server import PeerGate
from seamline.mesh.control.invites import InviteBook
from seamline.mesh.control.joining import Membership
from seamline.mesh.control.member_gate import Refusals, drawer, may_end, serves
from seamline.mesh.control.planning import Planning
from seamline.mesh.control.mesh_status import describe
from seamline.mesh.control.node_handle import NodeHandle
from seamline.mesh.control.peer_links import PeerLinks
from seamline.mesh.control.reference import Reference
from seamline.mesh.control.relay import Relay
from seamline.mesh.control.stage_checks import PROBE_TIMEOUT_S, StageFailedCheck, check_stages
from seamline.mesh.control.verify import CheckedStage, Verifier
from seamline.mesh.identity import MeshAuthority
from seamline.mesh.plan.types import ModelSpec, Plan, StageAssignment
from seamline.runtime.grammar import TokenMasks
from seamline.net.frames import LIMITS, FrameError, FrameType, TokenFrame, TokenRow
from seamline.net.link import LinkClosed
from seamline.net.messages import (
    PROTOCOL_VERSION, Assign, Close, Digests, Failure, Join, Linked, Loading, Message, Open, PeerLink, Pong, Probe,
    ProbeResult, Prompt, Ready, RelayAccept, Renew, Route, SpeedReady, SpeedSums, Stats, StatsRequest, encode_message,
)  # fmt: skip

log = logging.getLogger("seamline.coordinator")
STEP_TIMEOUT_S = 600.0  # loading a stage includes downloading its fragments
MAX_FRAGMENT_PEERS = 8  # members a loading node asks for fragments before the coordinator
MIN_RESIDENT_SHARE = 0.5  # a loaded stage's resident bytes, at least this share of its weights


@dataclass
class CoordinatorOptions:
    nodes_expected: int = 1
    dtype: str = "float32"
    context_length: int = 4096
    fragments_url: str = ""
    fragments_certificate: str = ""  # PEM, when the API (and so the fragments) is served over HTTPS
    locked_plan: Plan | None = None
    model_config: ModelConfig | None = None  # needed to form lockstep groups
    tensor_parallel: int = 0  # ranks per stage; 0: one node per stage unless a group is needed
    transport: str = "tcp"  # lockstep groups' Comm: auto | tcp | torch
    gate_timeout_s: float = 30.0
    insecure_comm: bool = False  # torch.distributed may run between hosts (it encrypts nothing)
    micro_batches: int = 0  # in flight in the pipeline (0: one per stage; fewer than the stages are not taken)
    live_growth: bool = True  # a node joining a serving mesh is planned in when it raises throughput enough
    kv_cache_bytes: int = 0  # stage 0's KV budget (0: most of its free memory)
    heartbeat_timeout_s: float = 3.0  # a member silent this long is lost
    state_dir: Path | None = None  # removed members are kept here
    package_dir: Path | None = None  # the packaged model: stages are checked against it (None: unchecked)
    verify_fraction: float = 0.0  # of requests followed through the coordinator's copy (``verify``)


TokenSink = Callable[[list[TokenRow]], None]
FailureSink = Callable[[int | None, str, str], None]  # request (None: all), reason, blame


class Coordinator(Membership, Planning):
    def __init__(self, invites: InviteBook, model: ModelSpec, model_hash: str, options: CoordinatorOptions,
                 authority: MeshAuthority | None = None) -> None:  # fmt: skip
        """``invites``: who may join; ``authority``: the mesh CA, whose certificates every link
        presents (None: plaintext links, for measuring what TLS costs)."""
        self.invites = invites
        self.invite = invites.where
        removed = options.state_dir / "removed.json" if options.state_dir else None
        self.enrollment = Enrollment(authority, removed_file=removed) if authority is not None else None
        self.model = model
        self.model_hash = model_hash
        self.options = options
        self.nodes: dict[str, NodeHandle] = {}
        self.plan: Plan | None = None
        self.plan_id = 0
        self.state = "waiting for nodes"
        self.ready = threading.Event()
        self.lock = threading.RLock()
        self.on_tokens: TokenSink = lambda rows: None
        self.on_failure: FailureSink = lambda request, reason, blame: None
        self.in_flight: Callable[[int], bool] = lambda request: False  # the backend's: a client waits on it
        self.refusals = Refusals()  # what members sent that was not theirs to say
        self.fragment_gate: PeerGate | None = None  # the fragment port's, over TLS (``serve.Mesh``)
        reference = Reference(options.package_dir, options.dtype) if options.package_dir else None
        self.verifier = Verifier(reference, options.verify_fraction, lambda rows: self.on_tokens(rows),
                                 self._expel, masks=_masks(options.package_dir))  # fmt: skip
        self._server: socket.socket | None = None
        self._fragment_tokens: dict[str, str] = {}  # node id -> its bearer token for fragment downloads
        self.link_key = ""  # the current plan's
        self._enrolled: dict[str, tuple[Join, float]] = {}  # certified, not yet attached: (join, deadline)
        self.relay = Relay()
        self.peer_links = PeerLinks()
        self._failed_starts = 0  # start-ups failed in a row (the retry's pause doubles with each)
        self.closing = False  # shut down on purpose (``shut_down``)

    # -- membership (joining: ``joining.Membership``) --------------------------------------
    def _read_node(self, handle: NodeHandle) -> None:
        while True:
            try:
                message = handle.link.recv()
            except (LinkClosed, FrameError) as exc:
                self._lost(handle, str(exc))
                handle.link.close()  # a frame it may not send (or a broken one): nothing more is read from it
                return
            handle.last_heard = time.monotonic()
            if isinstance(message, TokenFrame):
                self._take_tokens(handle, message)
            elif isinstance(message, (Ready, Linked)):
                plan_id = message.descriptor.plan_id if isinstance(message, Ready) else message.plan_id
                if plan_id != self.plan_id:  # a start-up a newer plan replaced
                    log.info("ignored node %s's %s for plan %d: plan %d is current", handle.node_id,
                             message.kind, plan_id, self.plan_id)  # fmt: skip
                    continue
                with handle.events:
                    if isinstance(message, Ready):
                        handle.ready, handle.loading = message, None
                    else:
                        handle.linked = True
                    handle.events.notify_all()
            elif isinstance(message, Loading):
                handle.loading = message if message.plan_id == self.plan_id else None
            elif isinstance(message, Stats):
                with handle.events:
                    handle.stats = message
                    handle.events.notify_all()
            elif isinstance(message, Failure):
                self._reported(handle, message)
            elif isinstance(message, Renew):
                self._renew(handle, message)
            elif isinstance(message, Pong) and not handle.pongs.arrived(message.nonce):
                log.warning("refused node %s's pong %d: no such ping is waiting", handle.node_id, message.nonce)
            elif isinstance(message, PeerLink) and not self.peer_links.report(handle.node_id, message):
                log.warning("ignored node %s's link report on %s: it was not asked", handle.node_id, message.peer_node)
            elif isinstance(message, (SpeedReady, SpeedSums)) and handle.speed_check is not None:
                handle.speed_check.answer(message)
            elif isinstance(message, Digests):
                self.verifier.digests(handle.node_id, message)
            elif isinstance(message, ProbeResult):
                with handle.events:
                    handle.probe_result = message
                    handle.events.notify_all()

    def _take_tokens(self, handle: NodeHandle, frame: TokenFrame) -> None:
        """Tokens go to their clients only from the node that draws them on the current plan,
        and only for requests in flight (a member's control link could name any request)."""
        plan = self.plan  # read once, without the lock a re-plan holds while it plans
        if handle.node_id != drawer(plan) or self.nodes.get(handle.node_id) is not handle:
            self.refusals.refuse(handle.node_id, "TOKEN frame: it does not draw the current plan's tokens",
                                 len(frame.rows))  # fmt: skip
            return
        rows = [row for row in frame.rows if self.in_flight(row.request)]
        if len(rows) < len(frame.rows):  # a client that went away leaves a few of these
            self.refusals.refuse(handle.node_id, "tokens for requests not in flight", len(frame.rows) - len(rows),
                                 logging.INFO)  # fmt: skip
        if rows:
            self.verifier.tokens(rows)  # held until checked, for a request the coordinator follows

    def _reported(self, handle: NodeHandle, message: Failure) -> None:
        """A node's failure report: its own start-up, or a request it serves. A node outside the
        plan serves no request, so its reports end none; only stage 0 and the drawing stage may
        end one (``member_gate``), another stage's report replays it."""
        log.warning("node %s reports: %s", handle.node_id, message.reason)  # one line: ``messages.Reason``
        if message.plan_id is not None:
            self._group_broke(handle, message)
            return
        if message.request is None:
            with handle.events:
                handle.failure = message.reason
                handle.events.notify_all()
            return
        plan = self.plan
        if not serves(plan, handle.node_id):
            log.warning("ignored node %s's report on a request: it serves no stage", handle.node_id)
            return
        ends = may_end(plan, handle.node_id)
        if message.blame != "node" and not (ends and self.in_flight(message.request)):
            self.refusals.refuse(handle.node_id, f"a report ending a request ({message.blame}): it is not stage 0 "
                                                 "or the drawing stage, or the request is not in flight")  # fmt: skip
            return
        reason = message.reason if message.blame != "node" else f"node {handle.node_id}: {message.reason}"
        self.on_failure(message.request, reason, message.blame if ends else "lost")

    def _group_broke(self, handle: NodeHandle, message: Failure) -> None:
        """The lockstep group ``handle`` serves in broke (a gate timed out or its link closed):
        the rank at fault is taken for lost, or, with none named, the group is formed again.
        Either way its requests replay. A report on an older plan, or naming a node outside
        the reporter's group, changes nothing."""
        with self.lock:
            current = self.plan is not None and message.plan_id == self.plan_id and self.nodes.get(handle.node_id) is handle
            group = next((s.members() for s in self.plan.stages if handle.node_id in s.members()), ()) if current else ()
            suspect = self.nodes.get(message.suspect) if message.suspect in group else None
        if not group or (message.suspect is not None and message.suspect not in group):
            log.warning("ignored node %s's report on plan %s's group (plan %d is current; it blames %s)",
                        handle.node_id, message.plan_id, self.plan_id, message.suspect)  # fmt: skip
        elif message.suspect is None or message.suspect == handle.node_id:
            with self.lock:
                if message.plan_id != self.plan_id:
                    return  # an earlier report on the same break re-planned already
                self._replan(f"the lockstep group of {handle.node_id} broke", message.reason)
        elif suspect is not None:
            self.lose(suspect, f"its lockstep group lost it: {message.reason}")

    def lose(self, handle: NodeHandle, reason: str) -> None:
        """Take a member for lost (it stopped answering): its links close, its requests replay."""
        self._lost(handle, reason)
        handle.link.close()

    def shut_down(self) -> None:
        """The mesh is being stopped on purpose: nodes that leave now are not planned around."""
        self.closing = True

    def _lost(self, handle: NodeHandle, reason: str) -> None:
        if self.closing:
            log.info("node %s left: %s (the mesh is shutting down)", handle.node_id, reason)
            return
        with self.lock:
            if self.nodes.get(handle.node_id) is not handle:
                return
            del self.nodes[handle.node_id]
            self.peer_links.forget(handle.node_id)
            in_plan = self.plan is not None and any(handle.node_id in s.members() for s in self.plan.stages)
        log.warning("node %s left: %s", handle.node_id, reason)
        with handle.events:
            handle.events.notify_all()
        if in_plan:
            self._replan(f"node {handle.node_id} left the mesh", reason)
        elif self.plan is None:  # no plan could be made: perhaps one can without this node
            self._maybe_plan()

    def _replan(self, event: str, detail: str) -> None:
        """The plan serves no more (``event``): plan again; requests in flight replay on the next."""
        self.ready.clear()
        self.state = f"{event}; re-planning"
        self.on_failure(None, f"{event} mid-request ({detail})", "lost")
        self._maybe_plan(force=True)
        with self.lock:
            if self.plan is None:
                self.state = f"{event}; {self.state}"

    # -- start-up (planning: ``planning.Planning``) ------------------------------------
    def _start_up(self, plan: Plan, plan_id: int) -> None:
        try:
            handles = [self.nodes[s.node_id] for s in plan.stages]  # the stages' leaders
            self.link_key = link_key = secrets.token_hex(16)  # data links between this plan's stages prove it
            for index in reversed(range(len(plan.stages))):
                self._current(plan_id)
                stage = plan.stages[index]
                self.state = f"loading layers [{stage.start},{stage.end}) on {', '.join(stage.members())}"
                senders = _senders(plan, index)
                self._assign_stage(stage, plan_id, link_key, senders)
            self._check_stages(plan, plan_id, handles)
            forks = all(len(s.members()) == 1 for s in plan.stages)  # a lockstep group's caches are not copied
            for index in reversed(range(len(handles))):
                self._current(plan_id)
                self.state = f"linking {handles[index].node_id}"
                self._link(handles, index, plan_id, forks)
        except Superseded:
            return
        except (StartupError, KeyError, LinkClosed) as exc:
            self._retry_later(plan_id, str(exc))
            return
        with self.lock:
            if plan_id != self.plan_id:
                return
            self.state = "ready"
            self._failed_starts = 0
            self.verifier.plan([CheckedStage((s.start, s.end), s.members()) for s in plan.stages])
            self.ready.set()
        log.info("route published: %s", " -> ".join(f"{s.node_id}[{s.start},{s.end})" for s in plan.stages))

    def _check_stages(self, plan: Plan, plan_id: int, leaders: list[NodeHandle]) -> None:
        """READY means loaded: every stage computes a probe as the coordinator's copy does
        (``stage_checks``); a stage that does not is removed from the mesh."""
        if self.verifier.reference is None:
            return
        self.state = "checking what every stage computes"
        try:
            check_stages(self.verifier.reference, plan, plan_id, leaders, self._ask_probe)
        except StageFailedCheck as exc:
            self._expel(list(exc.nodes), f"it failed the start-up check: {exc}")
            raise StartupError(f"{', '.join(exc.nodes)} failed the start-up check: {exc}") from None
        finally:
            self.verifier.reference.keep_only([])

    def _ask_probe(self, handle: NodeHandle, probe: Probe) -> ProbeResult:
        with handle.events:
            handle.probe_result = None
        handle.link.send_message(probe)
        answered = lambda: handle.probe_result if handle.probe_result and handle.probe_result.probe == probe.probe else None  # noqa: E731
        return self._wait(handle, answered, "PROBE RESULT", PROBE_TIMEOUT_S)  # type: ignore[no-any-return]

    def _expel(self, nodes: list[str], reason: str) -> None:
        """Members found computing something else than their layers: removed (``remove_node``)."""
        for node in nodes:
            log.error("removing node %s: %s", node, reason)
            self.verifier.expelled.append(node)
            self.remove_node(node)

    def _fragment_peers(self, handle: NodeHandle) -> list[str]:
        """The other members' fragment URLs (over TLS only: a member certificate is their key), of
        those that take inbound connections."""
        if self.enrollment is None:
            return []
        with self.lock:
            others = [h.join for h in self.nodes.values()
                      if h is not handle and h.checked and h.inbound and h.join.fragments_port]  # fmt: skip
        return [f"https://{_host(j.data_host)}:{j.fragments_port}" for j in others[:MAX_FRAGMENT_PEERS]]

    def _current(self, plan_id: int) -> None:
        """Superseded when a newer plan has been made since ``plan_id``'s start-up began."""
        if plan_id != self.plan_id:
            raise Superseded(f"plan {plan_id} was replaced by plan {self.plan_id}")

    def _assign_stage(self, s: StageAssignment, plan_id: int, link_key: str, senders: tuple[str, str]) -> None:
        """Assign every rank of the stage, then wait for all: a group's ranks load and meet together."""
        members = [self.nodes[m] for m in s.members()]
        group = [(h.join.data_host, h.join.comm_port) for h in members] if len(members) > 1 else []
        for rank, handle in enumerate(members):
            with handle.events:
                handle.ready, handle.linked, handle.failure = None, False, None
            handle.link.send_message(Assign(plan_id=plan_id, model_hash=self.model_hash,
                                            fragments_url=self.options.fragments_url,
                                            fragments_certificate=self.options.fragments_certificate,
                                            fragments_token=self._fragment_tokens.get(handle.node_id, ""),
                                            fragment_peers=self._fragment_peers(handle),
                                            layers=(s.start, s.end),
                                            owns_embedding=s.owns_embedding, owns_head=s.owns_head,
                                            dtype=self.options.dtype, context_length=self.options.context_length,
                                            memory_bytes=s.predicted_bytes, shard=(rank, len(members)), group=group,
                                            group_nodes=[h.node_id for h in members] if group else [],
                                            transport=self._transport(members),
                                            gate_timeout_s=self.options.gate_timeout_s,
                                            kv_cache_bytes=self.options.kv_cache_bytes, link_key=link_key,
                                            upstream_node=senders[0], last_node=senders[1],
                                            digest_seed=self.verifier.seed))  # fmt: skip
        for rank, handle in enumerate(members):
            try:
                ready = self._wait(handle, lambda h=handle: h.ready, "READY")  # type: ignore[misc]
            except StartupError:
                if handle.failure is not None:  # it could not load what it claimed room for: believed less
                    handle.memory_cap = min(handle.memory_cap or s.predicted_bytes, s.predicted_bytes // 2)
                raise
            d = ready.descriptor
            expected = (plan_id, self.model_hash, (s.start, s.end), self.options.dtype, PROTOCOL_VERSION,
                        (rank, len(members)))  # fmt: skip
            got = (d.plan_id, d.model_hash, tuple(d.layers), d.dtype, d.protocol_version, tuple(d.shard))
            if got != expected:
                raise StartupError(f"node {handle.node_id} reported {d} which does not match the plan {expected}")
            share = s.weight_bytes // len(members)
            if ready.resident_bytes < MIN_RESIDENT_SHARE * share:
                raise StartupError(f"node {handle.node_id} holds {ready.resident_bytes >> 20} MiB after loading "
                                   f"{share >> 20} MiB of weights: it does not hold what it was given")  # fmt: skip

    def _transport(self, members: list[NodeHandle]) -> str:
        cuda = all(h.join.resources.device.startswith("cuda") for h in members)
        hosts = {h.join.data_host for h in members}
        return choose_transport(self.options.transport, cuda, hosts, self.options.insecure_comm)

    def _link(self, handles: list[NodeHandle], index: int, plan_id: int, forks: bool) -> None:
        handle = handles[index]
        last = index == len(handles) - 1
        downstream, down_ticket = self._reach(None if last else handles[index + 1], handle)
        stage0, stage0_ticket = self._reach(handles[0] if last and index > 0 else None, handle)
        handle.link.send_message(Route(plan_id=plan_id, downstream=downstream, stage0=stage0, stages=len(handles),
                                       downstream_node=handles[index + 1].node_id if downstream else "",
                                       stage0_node=handles[0].node_id if stage0 else "",
                                       downstream_relay=down_ticket, stage0_relay=stage0_ticket,
                                       micro_batches=self.options.micro_batches, forks=forks))  # fmt: skip
        self._wait(handle, lambda: handle.linked or None, "LINKED")

    def _reach(self, target: NodeHandle | None, dialler: NodeHandle,
               probe: bool = False) -> tuple[tuple[str, int] | None, str]:  # fmt: skip
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

    def _wait(self, handle: NodeHandle, value: Callable[[], object], what: str, timeout_s: float = STEP_TIMEOUT_S) -> Any:
        deadline = time.monotonic() + timeout_s
        with handle.events:
            while (got := value()) is None:
                if handle.failure is not None:
                    raise StartupError(f"node {handle.node_id}: {handle.failure}")
                if handle.node_id not in self.nodes:
                    raise StartupError(f"node {handle.node_id} left before {what}")
                if not handle.events.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise StartupError(f"node {handle.node_id} sent no {what} within {timeout_s:.0f} s")
        return got

    # -- requests -----------------------------------------------------------------------
    def pipeline(self) -> list[NodeHandle]:
        with self.lock:
            if self.plan is None or not self.ready.is_set():
                raise StartupError(f"the mesh is not ready: {self.state}")
            return [self.nodes[s.node_id] for s in self.plan.stages]

    def open_request(self, open_msg: Open, tokens: list[int]) -> None:
        """Stage 0 opens the session and passes it down the pipeline ahead of the frames; the
        prompt follows in chunks. An Open larger than a node takes is the request's fault."""
        size = len(encode_message(open_msg))
        if size > LIMITS[FrameType.CONTROL]:
            raise RequestError(f"the request's sampling parameters take {size} bytes, more than the "
                               f"{LIMITS[FrameType.CONTROL]} a node takes in one message")  # fmt: skip
        stage0 = self.pipeline()[0]
        self.verifier.opened(open_msg, tokens)
        stage0.link.send_message(open_msg)
        for chunk in Prompt.chunks(open_msg.request, tokens):
            stage0.link.send_message(chunk)

    def close_request(self, request: int) -> None:
        """Stage 0 frees the request and tells the later stages, in order with its frames."""
        self.verifier.closed(request)
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
            with handle.events:
                handle.stats = None
            handle.link.send_message(StatsRequest())
        return [self._wait(h, lambda h=h: h.stats, "STATS", timeout_s) for h in handles]  # type: ignore[misc]

    def status(self) -> dict[str, object]:
        """What /api/status shows (``mesh_status``)."""
        return describe(self)


class StartupError(SeamlineError):
    """Start-up could not finish: a node left, timed out, or reported the wrong descriptor."""


class Superseded(SeamlineError):
    """A newer plan replaced the one being started."""


def _senders(plan: Plan, index: int) -> tuple[str, str]:
    """Who may dial stage ``index``'s leader: the stage before it, and for stage 0 of several the
    last stage (its tokens); "" where none."""
    upstream = plan.stages[index - 1].node_id if index > 0 else ""
    last = plan.stages[-1].node_id if index == 0 and len(plan.stages) > 1 else ""
    return upstream, last


def choose_transport(requested: str, cuda: bool, hosts: set[str], insecure_comm: bool) -> str:
    """A lockstep group's collectives. ``auto``: NCCL (torch) when every rank has CUDA, on one
    host (or with ``insecure_comm``); otherwise our TCP mesh, which on CPUs measured >10x faster
    than gloo for a 16 KB gate (NETWORK.md). torch.distributed encrypts nothing, so between
    hosts it is refused unless ``insecure_comm`` says the network is trusted."""
    across = len(hosts) > 1 and not insecure_comm
    if requested == "auto":
        return "torch" if cuda and not across else "tcp"
    if requested == "torch" and across:
        raise StartupError(f"--transport torch between hosts ({', '.join(sorted(hosts))}) would send every "
                           "activation unencrypted (gloo and NCCL have no TLS): use --transport tcp, or pass "
                           "--insecure-comm on a network you trust")  # fmt: skip
    return requested


__all__ = ["Coordinator", "CoordinatorOptions", "StartupError", "Message"]


def _masks(package_dir: Path | None) -> TokenMasks | None:
    """The grammars of followed requests, matched with the packaged tokenizer."""
    tokenizer = package_dir / "tokenizer.json" if package_dir else None
    return TokenMasks(lambda: tokenizer.read_text()) if tokenizer is not None and tokenizer.is_file() else None  # type: ignore[union-attr]


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
