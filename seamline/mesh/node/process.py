"""A node: joins a coordinator with an invite, loads the layers it is assigned, serves them.

Threads: the control link (coordinator messages), a data listener with one reader per
connection (hidden-state and token frames), and one short-lived thread per prompt. Compute
is serialised by the StageWorker's lock. A malformed frame closes only the connection that
sent it; an out-of-step frame is refused and logged; the node keeps serving.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import queue
import socket
import ssl
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from seamline.allocator import allocator_in_use
from seamline.errors import OverloadedError, RequestError
from seamline.mesh.arenas import tame_malloc
from seamline.mesh.node.checks import digest_reporter, probe_result
from seamline.mesh.node.credentials import Credentials
from seamline.mesh.node.data_path import DataPath
from seamline.mesh.node.fetch import FetchReport
from seamline.mesh.node.idle_probe import probe_when_idle
from seamline.mesh.node.kept_rows import kept_rows
from seamline.mesh.node.membership import Membership
from seamline.mesh.node.node_precision import take_precision
from seamline.mesh.node.node_stats import stage_stats
from seamline.mesh.node.peer_probe import probe_peer
from seamline.mesh.node.private_tail import load_tail, pair
from seamline.mesh.node.reprobe import reprobe_when_quiet
from seamline.mesh.node.stage_setup import (
    NoRoom,
    check_room,
    group_tls,
    loading_reporter,
    ready_report,
    stage_worker,
)
from seamline.mesh.protocol.claims import block_sums, probe_matrix
from seamline.mesh.protocol.fragment_server import PeerGate
from seamline.mesh.protocol.invite import Invite
from seamline.mesh.protocol.relay_wire import PROBE_MAGIC
from seamline.model.stage import Stage
from seamline.net.frames import Desync, FrameError, Oversized
from seamline.net.link import Link, LinkClosed, accept_links
from seamline.net.messages import (
    Assign,
    Certificate,
    Close,
    Failure,
    Heartbeat,
    Holding,
    Join,
    KeptRowsAsk,
    MeasurePeer,
    Message,
    Open,
    Ping,
    Pong,
    Probe,
    Prompt,
    RelayAccept,
    Revoked,
    Route,
    SpeedProbe,
    SpeedReady,
    SpeedSums,
    StatsRequest,
)
from seamline.parallel.comm import CommError
from seamline.runtime.grammar import TokenMasks
from seamline.runtime.group_stage import LockstepStage
from seamline.runtime.kept_inputs import KeptInputs
from seamline.runtime.lockstep_group import LockstepRank
from seamline.runtime.lockstep_leader import LockstepGroup
from seamline.runtime.openmp import on_passing_thread
from seamline.runtime.stage_worker import StageWorker

log = logging.getLogger("seamline.node")
COORDINATOR_SILENT_S = (
    10.0  # the coordinator sends a heartbeat every second; silent this long, it is lost
)


@dataclass
class NodeOptions:
    max_memory_bytes: int | None = None
    node_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
    cache_dir: Path = field(
        default_factory=lambda: Path(
            os.environ.get("SEAMLINE_CACHE", "~/.cache/seamline")
        ).expanduser()
    )
    data_port: int = 0
    progress: bool = True
    device: str = "auto"  # where this node's stage computes (``seamline.model.devices``)
    reprobe_when_idle: bool = (
        False  # probe the stage again once idle on quiet cores (``mesh.node.reprobe``)
    )


class Node(Membership, DataPath):
    def __init__(self, invite: Invite, options: NodeOptions) -> None:
        self.invite = invite
        self.options = options
        self.control: Link | None = None
        self.worker: StageWorker | None = None
        self.tail: StageWorker | None = (
            None  # a private mesh's last stage, beside stage 0 (``private_tail``)
        )
        self._data_links: dict[
            str, Link
        ] = {}  # the links this stage sends frames on, by the peer's node id
        self.assignment: Assign | None = None
        self.data_server: socket.socket | None = None
        self.peers: list[Link] = []  # this plan's data links, dialled and accepted
        self._inbox: queue.Queue[Message] = _Inbox(
            self._revoke
        )  # from the coordinator, for ``_handle_control``
        self.revoked: frozenset[str] = frozenset()  # nodes removed from the mesh: refused here too
        self.fragment_gate: PeerGate | None = None  # the fragment server's check of its clients
        self._peers_lock = threading.Lock()
        self._showing = threading.Lock()  # held while a proof of a sender's lie is being sent
        self.bytes_downloaded = 0
        self.comm_port = 0  # lockstep peers reach this node here
        self.comm_reservation: socket.socket | None = (
            None  # holds comm_port (net.link.reserve_port)
        )
        self.group_stage: LockstepStage | None = None  # this node leads a lockstep group
        self.credentials: Credentials | None = None  # None: a plaintext mesh
        self.joined_as: Join | None = None  # the join this node made (it rejoins with it)
        self._probe_matrix: torch.Tensor | None = None  # the coordinator's speed probe, made
        self._probe_answers = 0

    def _send_control(self, message: Message) -> None:
        assert self.control is not None
        self.control.send_message(message)

    def _report_quietly(self, message: Message) -> None:
        """Send on the control link; a broken link is found by its reader."""
        try:
            self._send_control(message)
        except LinkClosed:
            pass

    # -- serving ------------------------------------------------------------------------
    def serve(self) -> None:
        """Handle coordinator messages until the coordinator goes away."""
        assert self.control is not None and self.data_server is not None
        accept_links(
            self.data_server,
            "data",
            self._read_data,
            tls=self._server_context,
            plain={PROBE_MAGIC: lambda sock, _: sock.close()},
        )  # the coordinator asking if we take connections
        threading.Thread(target=self._handle_control, daemon=True, name="seamline-control").start()
        while True:
            try:
                message = self.control.recv(deadline_s=COORDINATOR_SILENT_S)
            except LinkClosed as exc:
                self.control.close()
                log.warning(
                    "coordinator link lost (%s); this node keeps its stage and rejoins", exc
                )
                if self.rejoin():
                    continue
                log.warning("node stops")
                return
            except FrameError as exc:
                if self._skip_bad_frame(exc):
                    continue
                self.control.close()
                log.error("the coordinator's link is out of step (%s); this node rejoins", exc)
                if self.rejoin():
                    continue
                log.warning("node stops")
                return
            if isinstance(
                message, Heartbeat
            ):  # answered here, never behind a busy stage or a send under way
                with contextlib.suppress(
                    LinkClosed
                ):  # (which the coordinator hears as well: it counts as heard)
                    self.control.try_send_message(Heartbeat(), COORDINATOR_SILENT_S)
            elif isinstance(message, Ping):  # likewise, so a measured round trip is the link's
                self._report_quietly(Pong(nonce=message.nonce))
            elif isinstance(message, Message):
                self._inbox.put(message)

    def _skip_bad_frame(self, exc: FrameError) -> bool:
        """A frame from the coordinator this node cannot take: refused, the link kept, when the
        stream is still in step (a malformed message read whole, or one over the cap, whose
        bytes are skipped); False when it is not (the link must be made again)."""
        assert self.control is not None
        if isinstance(exc, Desync):
            return False
        if isinstance(exc, Oversized):
            try:
                self.control.discard(exc.length)
            except LinkClosed:
                return False
        log.error("refused a message from the coordinator: %s", exc)
        return True

    def _server_context(self) -> ssl.SSLContext | None:
        return self.credentials.server if self.credentials else None

    def _on_control(self, message: Message) -> None:
        try:
            if isinstance(message, SpeedProbe):
                self._speed_probe(message)
            elif isinstance(message, RelayAccept):
                threading.Thread(target=self._accept_relayed, args=(message,), daemon=True).start()
            elif isinstance(message, MeasurePeer):
                threading.Thread(target=self._measure_peer, args=(message,), daemon=True).start()
            elif isinstance(message, Certificate) and self.credentials:
                self.credentials.accept(message.certificate)
            elif isinstance(message, Assign):
                self._load(message)
            elif isinstance(message, Route):
                self._route(message)
                self._probe_when_idle()  # linked: the start-up and its check are over
            elif isinstance(message, Open) and self.worker:
                self.worker.open(message)
            elif isinstance(message, Prompt) and self.worker:
                self.worker.prompt(message)  # queued for stage 0's scheduler
            elif isinstance(message, Close) and self.worker:
                self.worker.close(message)
            elif isinstance(message, Probe) and self.worker and self.control:
                tail = (
                    self.tail
                    if self.assignment and message.layers == self.assignment.tail
                    else None
                )
                self.control.send_message(
                    on_passing_thread(functools.partial(probe_result, tail or self.worker, message))
                )
            elif isinstance(message, KeptRowsAsk) and self.control:
                # its parts may be many: sent apart from the coordinator's other messages
                threading.Thread(target=self._send_kept_rows, args=(message,), daemon=True).start()
            elif isinstance(message, StatsRequest) and self.worker and self.control:
                self.control.send_message(
                    stage_stats(
                        self.options.node_id, self.worker, self._data_links, self.assignment
                    )
                )
        except Exception as exc:  # a failed step is reported, never fatal to the node
            log.exception("failed to handle %s", type(message).__name__)
            self._report(
                getattr(message, "request", None),
                f"{type(message).__name__} failed: {self._explain(exc)}",
                room=exc.room if isinstance(exc, NoRoom) else None,
            )

    def _send_kept_rows(self, ask: KeptRowsAsk) -> None:
        """The coordinator checks this stage on the rows it took (``kept_rows``)."""
        assert self.control is not None
        tail = self.tail if self.assignment and ask.layers == self.assignment.tail else None
        worker = tail or self.worker
        if worker is not None and self.assignment is not None:
            with contextlib.suppress(LinkClosed):  # a broken link is its reader's news
                for part in kept_rows(worker, ask, self.assignment.plan_id):
                    self.control.send_message(part)

    def _handle_control(self) -> None:
        """The coordinator's messages, in the order they came, apart from the control link's
        reader: loading a stage or a close waiting on a long step never delays a heartbeat. An
        Assign with a newer one queued behind it is dropped, not loaded: its plan is gone, and
        loading it (a group that may never form) would only hold up the plan that replaced it."""
        while True:
            message = self._inbox.get()
            if isinstance(message, Assign):
                with self._inbox.mutex:  # a peek at what is queued; the order of the rest is kept
                    newer = [m.plan_id for m in self._inbox.queue if isinstance(m, Assign)]
                if newer and max(newer) > message.plan_id:
                    log.info(
                        "skipped the assignment of plan %d: plan %d's is queued behind it",
                        message.plan_id,
                        max(newer),
                    )
                    continue
            self._on_control(message)

    def _batch_failed(self, requests: list[int], exc: Exception) -> None:
        """Stage 0 could not run these requests: the request's fault, the load's, or ours."""
        for request in requests:
            if isinstance(exc, RequestError):
                self._report(request, str(exc), "request")
            elif isinstance(exc, OverloadedError):
                self._report(request, str(exc), "load")
            else:
                self._report(request, f"stage 0 failed: {self._explain(exc)}", cause=exc)

    def _explain(self, exc: Exception) -> str:
        """The error's text; a group rank at fault is named by its node id too."""
        nodes = self.assignment.group_nodes if self.assignment else []
        if isinstance(exc, CommError) and exc.peer is not None and exc.peer < len(nodes):
            return f"{exc} (rank {exc.peer} is node {nodes[exc.peer]})"
        return str(exc)

    def _report(
        self,
        request: int | None,
        reason: str,
        blame: Literal["node", "request", "load"] = "node",
        cause: Exception | None = None,
        assign: Assign | None = None,
        room: int | None = None,
    ) -> None:
        """Tell the coordinator; a ``cause`` that broke the lockstep group of ``assign`` (the
        current one by default) says so, naming the rank's node at fault when it is known."""
        assign = assign or self.assignment
        plan_id = suspect = None
        if isinstance(cause, CommError) and assign is not None and assign.shard[1] > 1:
            plan_id, nodes = assign.plan_id, assign.group_nodes
            suspect = (
                nodes[cause.peer]
                if cause.peer is not None and 0 <= cause.peer < len(nodes)
                else None
            )
        if self.control is not None:
            try:
                self.control.send_message(
                    Failure(
                        request=request,
                        reason=reason,
                        blame=blame,
                        plan_id=plan_id,
                        suspect=suspect,
                        room_bytes=room,
                    )
                )
            except LinkClosed:
                pass

    def _load(self, assign: Assign) -> None:
        """Load ``assign``'s stage on a thread that ends: the stage's own thread keeps the only
        OpenMP pool (``runtime.openmp``), so its workers spin between a step's regions."""
        on_passing_thread(lambda: self._load_here(assign))

    def _load_here(self, assign: Assign) -> None:
        """Load ``assign``'s stage in place of the one held, wire it, and report READY."""
        self._drop_data_links()  # the old route's: no frame of it may reach the new stage
        take_precision(assign)
        kept = self._kept_stage(assign)
        self.assignment = assign
        self._probe_matrix = None  # the speed probe is over
        self._drop_stage()
        self._check_room(assign)
        if assign.shard[1] == 1:
            fetched = self._load_single(assign, kept)
        else:
            fetched = self._load_group(assign)
        if assign.tail is not None and self.worker is not None:
            fetched = self._load_tail(assign, fetched)
        self.bytes_downloaded += fetched.bytes_downloaded
        assert self.control is not None
        for worker, layers in ((self.worker, assign.layers), (self.tail, assign.tail)):
            self._wire(worker, assign, layers)  # type: ignore[arg-type]
        self.control.send_message(ready_report(assign, self.options.node_id, fetched))

    def _drop_stage(self) -> None:
        """A new assignment replaces the old stage (freed before the new one loads)."""
        if self.worker is not None:
            self.worker.stop()
        self.worker = self.tail = None
        gc.collect()
        if self.group_stage is not None:
            self.group_stage.close()
            self.group_stage = None

    def _load_single(self, assign: Assign, kept: Stage | None) -> FetchReport:
        """A stage of one node: ``kept`` where it holds it already, else fetched and loaded."""
        from seamline.mesh.node.loading import load_assignment

        stage, fetched = (
            (kept, FetchReport())
            if kept is not None
            else load_assignment(
                self.invite, assign, self.options, self._fetch_tls(), self._loading_reporter(assign)
            )
        )
        self.worker = stage_worker(stage, assign, stage.input_device)
        return fetched

    def _load_group(self, assign: Assign) -> FetchReport:
        """This node's rank of a lockstep group: the leader serves the group as a stage, another
        rank follows it on a thread of its own."""
        from seamline.mesh.node.loading import load_rank

        member, fetched = load_rank(
            self.invite,
            assign,
            self.options,
            group_tls(self.credentials, assign),
            self._fetch_tls(),
            self._loading_reporter(assign),
        )
        if member.rank == 0:  # the leader: its StageWorker drives the whole group
            self.group_stage = LockstepStage(LockstepGroup(member, assign.context_length))
            self.worker = stage_worker(self.group_stage, assign)
        else:
            threading.Thread(target=self._serve_rank, args=(member, assign), daemon=True).start()
        return fetched

    def _load_tail(self, assign: Assign, fetched: FetchReport) -> FetchReport:
        """A private mesh's last stage, beside stage 0: what both fetched."""
        assert self.worker is not None
        self.tail, tail_fetched = load_tail(
            self.invite, assign, self.options, self._fetch_tls(), self._loading_reporter(assign)
        )
        pair(self.worker, self.tail)
        return FetchReport(
            fetched.bytes_downloaded + tail_fetched.bytes_downloaded,
            bytes_from_peers=fetched.bytes_from_peers + tail_fetched.bytes_from_peers,
        )

    def _fetch_tls(self) -> ssl.SSLContext | None:
        return self.credentials.client if self.credentials else None

    def _wire(
        self, worker: StageWorker | None, assign: Assign, layers: tuple[int, int] | None
    ) -> None:
        """A loaded stage's reports to the coordinator: its tokens, failures and digests."""
        if worker is None or layers is None:
            return
        if (
            worker.is_last and worker.masks is None
        ):  # the last stage draws: a grammar needs the tokenizer
            folder = self.options.cache_dir / "stages" / self.options.node_id
            worker.masks = TokenMasks(lambda: (folder / "tokenizer.json").read_text())
        worker.links.results = lambda rows: self.control.send_tokens(rows)  # type: ignore[union-attr]  # the link of now
        worker.links.failed = self._batch_failed
        if assign.digest_seed:  # the coordinator checks what this stage computes
            worker.digest_seed = assign.digest_seed
            worker.links.digests = digest_reporter(assign.plan_id, self._report_quietly, layers)
            worker.links.sign = self._signer(assign.digest_seed)
            worker.kept = KeptInputs() if not worker.is_first else None

    def _loading_reporter(self, assign: Assign) -> Callable[[int, int], None]:
        """The download's progress, to the coordinator (``stage_setup.loading_reporter``)."""
        return loading_reporter(assign, self._report_quietly)

    def _kept_stage(self, assign: Assign) -> Stage | None:
        """The loaded stage, when ``assign`` asks this node for the very part it holds (a plan
        made again after a loss, or by a restarted coordinator): kept, not loaded again."""
        held = self._holding()
        if held is None or assign.shard != (0, 1) or held != Holding.of(assign):
            return None
        assert self.worker is not None  # a single node's stage (``_holding``), not a group's
        log.info("layers [%d,%d) stay loaded for plan %d", *assign.layers, assign.plan_id)
        return self.worker.stage  # type: ignore[return-value]

    def _layers(self) -> str:
        return (
            "?,?"
            if self.assignment is None
            else f"{self.assignment.layers[0]},{self.assignment.layers[1]}"
        )

    def _probe_when_idle(self) -> None:
        """The stage's speed probe, once it is linked and idle (``idle_probe``): a group's through
        its every rank and gate, as it serves; then a single node's stage again on quiet cores
        (``_reprobe``), not a group's: quiet cores here say nothing of the other ranks'."""
        worker = self.worker
        if worker is None:  # a lockstep rank other than the leader: the leader probes the group
            return

        def then() -> None:
            if isinstance(worker.stage, Stage):
                self._reprobe(worker, worker.stage)

        probe_when_idle(worker, worker.stage, lambda: self.worker is worker, then)

    def _reprobe(self, worker: StageWorker, stage: Stage) -> None:
        """With ``--reprobe-when-idle``: probe the stage again once it is idle and its cores quiet
        (its loading probe ran beside its peers' loading), while it serves this assignment. Off
        by default: each try costs a probe's CPU, and a request that comes waits a forward."""
        if worker.step_probe and self.options.reprobe_when_idle:
            reprobe_when_quiet(worker, stage, lambda: self.worker is worker)

    def _serve_rank(self, member: LockstepRank, assign: Assign) -> None:
        """A group's other rank: follow the leader until it shuts the group down or a link breaks
        (reported: the coordinator re-forms the group, without the rank at fault)."""
        try:
            member.serve()
        except Exception as exc:
            log.error("lockstep rank %d stopped: %s", member.rank, exc)
            self._report(
                None,
                f"lockstep rank {member.rank} stopped: {self._explain(exc)}",
                cause=exc,
                assign=assign,
            )
        finally:
            member.close()

    def _check_room(self, assign: Assign) -> None:
        """Refuse an assignment this node cannot hold, before downloading anything."""
        check_room(assign, self.options.max_memory_bytes)

    def _speed_probe(self, probe: SpeedProbe) -> None:
        """The coordinator checks the speed this node claimed: make the matrix, then multiply."""
        assert self.control is not None
        if not probe.vector:
            self._probe_matrix = on_passing_thread(
                functools.partial(probe_matrix, probe.seed, probe.rows, probe.cols)
            )
            self.control.send_message(SpeedReady())
        elif self._probe_matrix is not None and len(probe.vector) == self._probe_matrix.shape[1]:
            self._probe_answers += 1  # alternately on all threads and on one: the fastest counts
            sums = on_passing_thread(
                functools.partial(
                    block_sums,
                    self._probe_matrix,
                    torch.tensor(probe.vector),
                    one_thread=self._probe_answers % 2 == 0,
                )
            )
            self.control.send_message(SpeedSums(sums=sums))

    def _measure_peer(self, ask: MeasurePeer) -> None:
        report = probe_peer(
            ask, self.options.node_id, self.credentials.client if self.credentials else None
        )
        if report.error:
            log.warning("could not measure the link to %s: %s", ask.peer_node, report.error)
        self._report_quietly(report)

    def _revoke(self, message: Revoked) -> None:
        """Nodes removed from the mesh: refused from now on at the fragment and data ports, and
        every link this node holds to one closed."""
        self.revoked = self.revoked | frozenset(message.node_ids)
        if self.fragment_gate is not None:
            self.fragment_gate.drop()
        with self._peers_lock:
            gone = [link for link in self.peers if link.peer_id() in self.revoked]
        for link in gone:
            log.warning("closing %s: node %s was removed from the mesh", link.name, link.peer_id())
            link.close()


class _Inbox(queue.Queue[Message]):
    """The coordinator's messages for ``_handle_control``, in order, except a Revoked: applied as
    it arrives, never behind a stage that is loading (a removed node must not fetch meanwhile)."""

    def __init__(self, revoke: Callable[[Revoked], None]) -> None:
        super().__init__()
        self._revoke = revoke

    def put(self, item: Message, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, Revoked):
            self._revoke(item)
        else:
            super().put(item, block, timeout)


def run_node(token: str, options: NodeOptions) -> int:
    tame_malloc()
    invite = Invite.decode(token)
    node = Node(invite, options)
    node.join()
    log.info(
        "memory allocator: %s", allocator_in_use()
    )  # once joined: a failed join's error stays its one line
    node.serve()
    return 0
