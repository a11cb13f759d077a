"""READY means loaded: before a route is published, every stage computes a random probe, and
its answer is checked against the same layers computed from the coordinator's own copy of the
weights (``reference``; a lockstep group's as its ranks compute them). A stage that answers
wrongly (or not at all) is removed from the mesh, and the start-up is planned again without
it; a member that claimed more memory than it has cannot pass either, since it must hold and
run every layer it was given."""

from __future__ import annotations

import base64
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from seamline.mesh.control.reference import Reference
from seamline.mesh.plan.types import Plan
from seamline.net.messages import Probe, ProbeResult
from seamline.runtime import digest

if TYPE_CHECKING:
    from seamline.mesh.control.node_handle import NodeHandle

log = logging.getLogger("seamline.coordinator")
PROBE_TIMEOUT_S = 120.0  # a stage computes 4 rows; a lockstep group's ranks take part


class StageFailedCheck(Exception):
    """A stage answered its probe wrongly: ``nodes`` are at fault."""

    def __init__(self, nodes: tuple[str, ...], reason: str) -> None:
        super().__init__(reason)
        self.nodes = nodes


Ask = Callable[
    ["NodeHandle", Probe], ProbeResult
]  # send a probe to a stage's leader, wait for its answer


def check_stages(
    reference: Reference, plan: Plan, plan_id: int, leaders: list[NodeHandle], ask: Ask
) -> None:
    """Probe every stage of ``plan``; StageFailedCheck names the first that answers wrongly."""
    generator = torch.Generator().manual_seed(secrets.randbits(62))
    seed = secrets.randbits(62)
    for stage, leader in zip(plan.stages, leaders):
        layers = (stage.start, stage.end)
        ids, hidden = reference.probe_inputs(layers, generator)
        expected, scale = reference.probe(layers, ids, hidden, seed, world=len(stage.members()))
        raw = (
            base64.b64encode(hidden.contiguous().view(torch.uint8).numpy().tobytes()).decode()
            if hidden is not None
            else ""
        )
        result = ask(
            leader,
            Probe(
                plan_id=plan_id,
                probe=secrets.randbits(31),
                seed=seed,
                ids=ids.tolist(),
                hidden=raw,
                layers=layers,
            ),
        )
        reason = _judge(result, expected, scale, reference.dtype)
        if reason:
            raise StageFailedCheck(stage.members(), f"layers [{stage.start},{stage.end}): {reason}")
        log.info(
            "stage %s [%d,%d) computed its probe as the coordinator does", leader.node_id, *layers
        )


def _judge(result: ProbeResult, expected: torch.Tensor, scale: float, dtype: torch.dtype) -> str:
    """Why ``result`` is not the stage's answer ("" when it is)."""
    if result.error:
        return f"it could not run the probe: {result.error}"
    try:
        got = digest.unpack(result.digest, 1, 1)[0, 0]
    except ValueError as exc:
        return f"its answer is malformed: {exc}"
    gap = digest.differs(got, expected, scale, dtype)
    return f"its answer is {gap:.0f}x the tolerance from the coordinator's" if gap > 1 else ""
