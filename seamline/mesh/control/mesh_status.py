"""/api/status: the plan, the nodes (address, reachability, measured link, memory, downloads)
and, while the mesh serves, each stage's open sequences and KV bytes, asked of the stages now."""

from __future__ import annotations

from typing import TYPE_CHECKING

from seamline.errors import SeamlineError
from seamline.mesh.control.planning import pace
from seamline.mesh.plan.cores import core_shares
from seamline.net.link import LinkClosed
from seamline.precision import Precision
from seamline.runtime.speculation import speculated

if TYPE_CHECKING:
    from seamline.mesh.control.coordinator import Coordinator
    from seamline.mesh.control.node_handle import NodeHandle

STATUS_TIMEOUT_S = 2.0  # /api/status waits this long for the stages' counters


def describe(coordinator: Coordinator) -> dict[str, object]:
    state = coordinator.keeper.current  # one state: plan, members and readiness read together
    plan = state.plan
    stages = (
        []
        if plan is None
        else [
            {
                "node_id": s.node_id,
                "layers": [s.start, s.end],
                "embedding": s.owns_embedding,
                "head": s.owns_head,
                "weight_bytes": s.weight_bytes,
                "ranks": list(s.members()),
                "device": s.gpu_device or "cpu",
                "gpu_layers": s.gpu_layers,
                "predicted_step_ms": round(s.compute_s * 1e3, 3),
                "predicted_under_load_ms": round(s.under_load_s * 1e3, 3),
            }
            for s in plan.stages
        ]
    )
    shares = core_shares(h.placement() for h in state.nodes.values())
    nodes = [_node(h, shares[h.node_id]) for h in state.nodes.values()]
    _add_holdings(coordinator, stages)
    return {
        "ready": state.ready,
        "state": state.phase,
        "plan_id": state.plan_id,
        "stages": stages,
        "nodes": nodes,
        "relayed_links": coordinator.relay.pairs,
        "links": coordinator.peer_links.describe(),
        "backing_off": coordinator.back_off.waiting(),  # members that failed: seconds until planned
        "refused_from_members": dict(
            coordinator.refusals.counts
        ),  # tokens and reports not theirs to send
        "verification": coordinator.verifier.describe(),
        "precision": Precision(
            coordinator.options.precision,
            coordinator.options.dtype,
            coordinator.options.int8_activations,
        ).as_dict(),
        "predicted_ms_per_token": plan.predicted_s_per_token * 1e3 if plan else None,
        "pace_ms": pace(plan) * 1e3
        if plan
        else None,  # per token under load (what planning compares)
        "rate_corrections": dict(
            coordinator.balance.corrections
        ),  # from the stages' measured steps (``balance``)
        "balance_held": coordinator.balance.held,  # an administrator holds the plan: no re-balance
        "balance_settled": coordinator.balance.settled(),  # a decision under load kept the plan, or none will come
        "model": coordinator.model.name,
        "events": coordinator.feed.recent(),
    }


def _node(h: NodeHandle, core_share: float) -> dict[str, object]:
    measured = h.measured
    return {
        "node_id": h.node_id,
        "address": f"{h.join.data_host}:{h.join.data_port}",
        "inbound": h.inbound,
        "relayed": not h.inbound,
        "checked": h.checked,
        "rtt_ms": round(measured.latency_s * 2e3, 3) if measured else None,
        "bandwidth_mb_s": round(measured.bandwidth_bytes_per_s / 1e6, 1) if measured else None,
        "free_memory_bytes": h.join.resources.free_memory_bytes,
        "bytes_per_second": h.join.resources.bytes_per_second,  # as it claimed
        "proven_bytes_per_second": h.proven_rate,  # on the coordinator's timed product
        "served_bytes_per_second": h.served_rate,  # when its stage served clearly slower than planned
        "core_share": round(core_share, 4),
        "planned_bytes_per_second": h.info(core_share).bytes_per_second,
        "bytes_downloaded": h.ready.bytes_downloaded if h.ready else None,
        "bytes_from_peers": h.ready.bytes_from_peers if h.ready else None,
        "resident_bytes": h.ready.resident_bytes if h.ready else None,
        "downloading": {"bytes_done": h.loading.bytes_done, "bytes_total": h.loading.bytes_total}
        if h.loading
        else None,
    }


def _add_holdings(coordinator: Coordinator, stages: list[dict[str, object]]) -> None:
    if not coordinator.ready.is_set():
        return
    try:
        stats = coordinator.stage_stats(timeout_s=STATUS_TIMEOUT_S)
    except (SeamlineError, LinkClosed, TimeoutError):
        return  # a stage that does not answer: status says what the plan says
    speculation = speculated(stats)
    if speculation is not None:
        stages[0]["speculation"] = {
            "method": coordinator.startup.speculation,  # ngram, or mtp: the last stage drafts
            "windows": speculation.windows,
            "drafted": speculation.drafted,
            "accepted": speculation.accepted,
            "follows": speculation.follows,
            "stale": speculation.stale,
            "acceptance": speculation.acceptance,
            "tokens_per_window": speculation.tokens_per_window,
        }
    for stage, stat in zip(stages, stats):
        stage.update(
            sequences=stat.sequences,
            kv_bytes=stat.kv_bytes,
            kept_kv_bytes=stat.kept_kv_bytes,
            decode_steps=stat.decode_steps,
            decode_seconds=round(stat.decode_seconds, 3),
            busy_seconds=round(stat.busy_seconds, 3),
            idle_seconds=round(stat.idle_seconds, 3),
        )
        if stat.decode_steps:  # beside the plan's predicted_step_ms (one row) and under load
            stage["measured_step_ms"] = round(stat.decode_seconds / stat.decode_steps * 1e3, 3)
        if stat.precision:
            stage["precision"] = stat.precision
        if stat.micro_batches:
            stage["micro_batches"] = stat.micro_batches
        if stat.step_probe_s:  # rows -> ms of one step, as the stage probed itself after loading
            stage["step_probe_ms"] = {
                str(rows): round(s * 1e3, 3) for rows, s in sorted(stat.step_probe_s.items())
            }
            prompts = sorted(
                stat.prompt_probe_s.items()
            )  # prompt rows -> ms of a step of that many
            stage["prompt_probe_ms"] = {str(rows): round(s * 1e3, 3) for rows, s in prompts}
            stage["probe_quiet"] = stat.probe_quiet  # taken again on an idle stage and quiet cores
        if stat.step_overhead_s:  # a decode step's CPU seconds outside its forward, as it serves
            overhead = sorted(stat.step_overhead_s.items())
            stage["step_overhead_ms"] = {str(rows): round(s * 1e3, 3) for rows, s in overhead}
        if stat.ring_s:  # stage 0: one stream's row from leaving it to its token coming back
            stage["ring_ms"] = round(stat.ring_s * 1e3, 3)
        if stat.cycle_wall_s:  # one row's wall time on this stage, from taken to handed on
            stage["cycle_ms"] = round(stat.cycle_wall_s * 1e3, 3)
