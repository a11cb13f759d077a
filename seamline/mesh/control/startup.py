"""Start-up of a plan: its stages assigned and loaded all at once (the route waits for the
slowest, not for each in turn), checked against the coordinator's copy (``stage_checks``, its
answers computed while they load), then linked downstream first; only then is the route
published (``Coordinator.startup``); a newer plan supersedes one being started.
A private plan's last stage is the first stage's node: it is assigned and linked with it."""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING

from seamline.errors import SeamlineError
from seamline.mesh.control.mesh_state import RoutePublished, StartupStep
from seamline.mesh.control.stage_checks import (
    PROBE_TIMEOUT_S,
    Expectations,
    StageFailedCheck,
    check_stages,
)
from seamline.mesh.control.verify import CheckedStage
from seamline.mesh.plan.types import Plan, StageAssignment
from seamline.net.link import LinkClosed
from seamline.net.messages import PROTOCOL_VERSION, Assign, Probe, ProbeResult, Ready, Route

if TYPE_CHECKING:
    from seamline.mesh.control.coordinator import Coordinator
    from seamline.mesh.control.node_handle import NodeHandle

log = logging.getLogger("seamline.coordinator")
STEP_TIMEOUT_S = 600.0  # loading a stage includes downloading its fragments
MAX_FRAGMENT_PEERS = 8  # members a loading node asks for fragments before the coordinator
MIN_RESIDENT_SHARE = 0.5  # a loaded stage's resident bytes, at least this share of its weights


class StartUp:
    """Starting a plan (``Coordinator.startup``); its steps are the coordinator's events."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.options = coordinator.options
        self.link_key = ""  # the current plan's: data links between its stages prove it
        self.speculation = "off"  # the current plan's route: how stage 0 drafts

    def run(self, plan: Plan, plan_id: int) -> None:
        c = self.coordinator
        try:
            handles = [c.nodes[s.node_id] for s in plan.stages]  # the stages' leaders
            self.link_key = link_key = secrets.token_hex(16)
            self.speculation = self._speculation(plan)
            reference = c.verifier.reference
            expected = Expectations(reference, plan) if reference is not None else None
            loaded = list(reversed(range(len(plan.loaded_stages()))))
            tails = [plan.stages[-1] if plan.private and i == 0 else None for i in loaded]
            for index, tail in zip(loaded, tails):
                self._current(plan_id)
                self._assign_stage(
                    plan.stages[index], plan_id, link_key, _senders(plan, index), tail
                )
            for index, tail in zip(loaded, tails):
                self._current(plan_id)
                stage = plan.stages[index]
                on = ", ".join(stage.members())
                c.apply(StartupStep(plan_id, f"loading layers [{stage.start},{stage.end}) on {on}"))
                self._await_stage(stage, plan_id, tail)
            self._check_stages(plan, plan_id, handles, expected)
            forks = all(
                len(s.members()) == 1 for s in plan.stages
            )  # a lockstep group's caches are not copied
            for index in reversed(range(len(plan.loaded_stages()))):
                self._current(plan_id)
                c.apply(StartupStep(plan_id, f"linking {handles[index].node_id}"))
                self._link(handles, index, plan_id, forks)
        except Superseded:
            return
        except (StartupError, KeyError, LinkClosed) as exc:
            c.planning.retry_later(plan_id, str(exc))
            return
        except (
            Exception
        ) as exc:  # a fault of ours: said and retried, never a start-up stuck half way
            log.exception("start-up of plan %d failed", plan_id)
            c.planning.retry_later(plan_id, f"{type(exc).__name__}: {exc}")
            return
        with c.lock:
            if plan_id != c.plan_id:
                return
            stages = [CheckedStage((s.start, s.end), s.members()) for s in plan.stages]
            c.verifier.plan(stages, plan_id)
            c.apply(RoutePublished(plan_id))

    def _check_stages(
        self,
        plan: Plan,
        plan_id: int,
        leaders: list[NodeHandle],
        expected: Expectations | None,
    ) -> None:
        """READY means loaded: every stage computes a probe as the coordinator's copy does
        (``stage_checks``); a stage that does not is removed from the mesh."""
        reference = self.coordinator.verifier.reference
        if reference is None or expected is None:  # no copy to check against
            return
        self.coordinator.apply(StartupStep(plan_id, "checking what every stage computes"))
        try:
            check_stages(expected, plan, plan_id, leaders, self._ask_probe)
        except StageFailedCheck as exc:
            self.expel(list(exc.nodes), f"it failed the start-up check: {exc}")
            raise StartupError(f"{', '.join(exc.nodes)} failed the start-up check: {exc}") from None
        finally:
            reference.keep_only([])

    def _ask_probe(self, handle: NodeHandle, probe: Probe) -> ProbeResult:
        with handle.changed:
            handle.probe_result = None
        handle.link.send_message(probe)
        answered = lambda: (
            handle.probe_result
            if handle.probe_result and handle.probe_result.probe == probe.probe
            else None
        )  # noqa: E731
        return self.coordinator.wait_for(handle, answered, "PROBE RESULT", PROBE_TIMEOUT_S)  # type: ignore[no-any-return]

    def expel(self, nodes: list[str], reason: str) -> None:
        """Members found computing something else than their layers: removed (``remove_node``)."""
        for node in nodes:
            log.error("removing node %s: %s", node, reason)
            self.coordinator.verifier.expelled.append(node)
            self.coordinator.remove_node(node)

    def _fragment_peers(self, handle: NodeHandle) -> list[str]:
        """The other members' fragment URLs (over TLS only: a member certificate is their key), of
        those that take inbound connections."""
        c = self.coordinator
        if c.enrollment is None:
            return []
        own = c.own_node() if self.options.private else ""  # a private mesh's ends serve no member
        others = [
            h.join
            for h in c.nodes.values()
            if h is not handle
            and h.checked
            and h.inbound
            and h.join.fragments_port
            and h.node_id != own
        ]
        return [
            f"https://{_host(j.data_host)}:{j.fragments_port}" for j in others[:MAX_FRAGMENT_PEERS]
        ]

    def _current(self, plan_id: int) -> None:
        """Superseded when a newer plan has been made since ``plan_id``'s start-up began."""
        current = self.coordinator.plan_id
        if plan_id != current:
            raise Superseded(f"plan {plan_id} was replaced by plan {current}")

    def _assign_stage(
        self,
        s: StageAssignment,
        plan_id: int,
        link_key: str,
        senders: tuple[str, str],
        tail: StageAssignment | None = None,
    ) -> None:
        """Assign every rank of the stage (a group's ranks load and meet together); ``tail``: a
        private plan's last stage, which the first stage's node holds too."""
        c = self.coordinator
        members = [c.nodes[m] for m in s.members()]
        for rank, handle in enumerate(members):
            with handle.changed:
                handle.ready, handle.linked, handle.failure = None, False, None
            handle.link.send_message(
                self._assignment(s, plan_id, link_key, senders, tail, members, rank)
            )

    def _await_stage(self, s: StageAssignment, plan_id: int, tail: StageAssignment | None) -> None:
        """Wait for every rank of the stage ``s`` to be READY as the plan gave it."""
        c = self.coordinator
        members = [c.nodes[m] for m in s.members()]
        for rank, handle in enumerate(members):
            ready = c.wait_for(handle, lambda h=handle: h.ready, "READY", STEP_TIMEOUT_S)  # type: ignore[misc]
            self._check_ready(s, plan_id, handle, ready, (rank, len(members)), tail)

    def _assignment(
        self,
        s: StageAssignment,
        plan_id: int,
        link_key: str,
        senders: tuple[str, str],
        tail: StageAssignment | None,
        members: list[NodeHandle],
        rank: int,
    ) -> Assign:
        """The Assign of rank ``rank`` of the stage ``s``, whose ranks are ``members``."""
        c = self.coordinator
        handle = members[rank]
        group = [(h.join.data_host, h.join.comm_port) for h in members] if len(members) > 1 else []
        return Assign(
            plan_id=plan_id,
            model_hash=c.model_hash,
            fragments_url=self.options.fragments_url,
            fragments_certificate=self.options.fragments_certificate,
            fragments_token=c.joining.fragment_token(handle.node_id),
            fragment_peers=self._fragment_peers(handle),
            layers=(s.start, s.end),
            owns_embedding=s.owns_embedding,
            owns_head=s.owns_head,
            dtype=self.options.dtype,
            context_length=self.options.context_length,
            int8_activations=self.options.int8_activations,
            rows_alone=self.options.rows_alone,
            mtp=s.owns_head and self.speculation == "mtp",
            # what its system memory holds: not its GPU's share (``plan.split``)
            memory_bytes=s.predicted_bytes - s.gpu_bytes + (tail.predicted_bytes if tail else 0),
            gpu_layers=s.gpu_layers,
            shard=(rank, len(members)),
            group=group,
            group_nodes=[h.node_id for h in members] if group else [],
            transport=self._transport(members),
            gate_timeout_s=self.options.gate_timeout_s,
            kv_cache_bytes=self.options.kv_cache_bytes,
            link_key=link_key,
            upstream_node=senders[0],
            last_node=senders[1],
            digest_seed=c.verifier.seed,
            tail=(tail.start, tail.end) if tail else None,
        )

    def _check_ready(
        self,
        s: StageAssignment,
        plan_id: int,
        handle: NodeHandle,
        ready: Ready,
        shard: tuple[int, int],
        tail: StageAssignment | None,
    ) -> None:
        """A rank's READY must describe what the plan gave it, and its memory hold its share."""
        d = ready.descriptor
        expected = (
            plan_id,
            self.coordinator.model_hash,
            (s.start, s.end),
            self.options.dtype,
            self.options.int8_activations,
            PROTOCOL_VERSION,
            shard,
            (tail.start, tail.end) if tail else None,
        )
        got = (
            d.plan_id,
            d.model_hash,
            tuple(d.layers),
            d.dtype,
            d.int8_activations,
            d.protocol_version,
            tuple(d.shard),
            tuple(d.tail) if d.tail else None,
        )
        if got != expected:
            raise StartupError(
                f"node {handle.node_id} reported {d} which does not match the plan {expected}"
            )
        share = s.weight_bytes // shard[1]
        if ready.resident_bytes < MIN_RESIDENT_SHARE * share:
            raise StartupError(
                f"node {handle.node_id} holds {ready.resident_bytes >> 20} MiB after loading "
                f"{share >> 20} MiB of weights: it does not hold what it was given"
            )

    def _speculation(self, plan: Plan) -> str:
        o = self.options
        return route_speculation(
            o.speculation, o.private, o.verify_fraction, len(plan.stages[-1].members())
        )

    def _transport(self, members: list[NodeHandle]) -> str:
        placed = [(h.join.data_host, h.join.resources.device) for h in members]
        return choose_transport(
            self.options.transport,
            gpus_apart(placed),
            {host for host, _ in placed},
            self.options.insecure_comm,
        )

    def _link(self, handles: list[NodeHandle], index: int, plan_id: int, forks: bool) -> None:
        handle = handles[index]
        last = index == len(handles) - 1
        downstream, down_ticket = self.coordinator.reach(
            None if last else handles[index + 1], handle
        )
        stage0, stage0_ticket = self.coordinator.reach(
            handles[0] if last and index > 0 else None, handle
        )
        handle.link.send_message(
            Route(
                plan_id=plan_id,
                downstream=downstream,
                stage0=stage0,
                stages=len(handles),
                downstream_node=handles[index + 1].node_id if downstream else "",
                stage0_node=handles[0].node_id if stage0 else "",
                downstream_relay=down_ticket,
                stage0_relay=stage0_ticket,
                micro_batches=self.options.micro_batches,
                forks=forks,
                speculation=self.speculation,
                draft_max=self.options.draft_max,
            )
        )
        self.coordinator.wait_for(handle, lambda: handle.linked or None, "LINKED", STEP_TIMEOUT_S)


def route_speculation(mode: str, private: bool, verify_fraction: float, last_ranks: int = 1) -> str:
    """How a route drafts: not where rows are checked (``--verify-fraction``) or members see no
    token (``--private``: a later stage could not check where a window goes on). With ``mtp``
    the last stage drafts with the model's multi-token-prediction layer, where it is one node
    (``last_ranks``; a lockstep group's head is split: n-grams there)."""
    if private or verify_fraction > 0:
        return "off"
    return "ngram" if mode == "mtp" and last_ranks > 1 else mode


class StartupError(SeamlineError):
    """Start-up could not finish: a node left, timed out, or reported the wrong descriptor."""


class Superseded(SeamlineError):
    """A newer plan replaced the one being started."""


def _senders(plan: Plan, index: int) -> tuple[str, str]:
    """Who may dial stage ``index``'s leader: the stage before it, and for stage 0 of several the
    last stage (its tokens); "" where none. A private plan's first node is its last stage too:
    the member before the last dials it, and its tokens go to stage 0 within the node."""
    if plan.private and index == 0:
        return plan.stages[-2].node_id, ""
    upstream = plan.stages[index - 1].node_id if index > 0 else ""
    last = plan.stages[-1].node_id if index == 0 and len(plan.stages) > 1 else ""
    return upstream, last


def gpus_apart(placed: list[tuple[str, str]]) -> bool:
    """Whether every rank (host, device) computes on a GPU of its own: NCCL takes one rank per
    GPU, so ranks that share one (or any on a CPU) keep to the TCP mesh."""
    return all(device.startswith("cuda") for _, device in placed) and len(set(placed)) == len(
        placed
    )


def choose_transport(requested: str, cuda: bool, hosts: set[str], insecure_comm: bool) -> str:
    """A lockstep group's collectives. ``auto``: NCCL (torch) when every rank has CUDA, on one
    host (or with ``insecure_comm``); otherwise our TCP mesh, which on CPUs measured >10x faster
    than gloo for a 16 KB gate (NETWORK.md). torch.distributed encrypts nothing, so between
    hosts it is refused unless ``insecure_comm`` says the network is trusted."""
    across = len(hosts) > 1 and not insecure_comm
    if requested == "auto":
        return "torch" if cuda and not across else "tcp"
    if requested == "torch" and across:
        raise StartupError(
            f"--transport torch between hosts ({', '.join(sorted(hosts))}) would send every "
            "activation unencrypted (gloo and NCCL have no TLS): use --transport tcp, or pass "
            "--insecure-comm on a network you trust"
        )
    return requested


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
