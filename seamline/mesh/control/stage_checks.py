"""READY means loaded: before a route is published, every stage computes a random probe, and
its answer is checked against the same layers computed from the coordinator's own copy of the
weights (``reference``; a lockstep group's as its ranks compute them), computed while the
stages load. A stage that answers wrongly (or not at all) is removed from the mesh, and the
start-up is planned again without it; a member that claimed more memory than it has cannot
pass either, since it must hold and run every layer it was given."""

from __future__ import annotations

import base64
import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Expected:
    """One stage's probe and the answer the coordinator's copy gives to it."""

    ids: torch.Tensor
    hidden: torch.Tensor | None
    answer: torch.Tensor
    scale: float


class Expectations:
    """The answers every stage of a plan must give, computed on a thread of their own while the
    stages load (the route waits for the slower of the two, not for both in turn)."""

    def __init__(self, reference: Reference, plan: Plan) -> None:
        self.seed = secrets.randbits(62)
        self.dtype = reference.dtype
        self.rows_alone = reference.rows_alone
        self._reference, self._plan = reference, plan
        self._answers: list[Expected] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._compute, name="seamline-expected-probes", daemon=True
        )
        self._thread.start()

    def _compute(self) -> None:
        generator = torch.Generator().manual_seed(secrets.randbits(62))
        try:
            for stage in self._plan.stages:
                layers = (stage.start, stage.end)
                ids, hidden = self._reference.probe_inputs(layers, generator)
                answer, scale = self._reference.probe(
                    layers, ids, hidden, self.seed, world=len(stage.members())
                )
                self._answers.append(Expected(ids, hidden, answer, scale))
        except BaseException as exc:  # noqa: BLE001 - raised again where the answers are read
            self._error = exc

    def answers(self) -> list[Expected]:
        """Every stage's, in the plan's order, once computed (its error raised here)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._answers


def check_stages(
    expectations: Expectations, plan: Plan, plan_id: int, leaders: list[NodeHandle], ask: Ask
) -> None:
    """Probe every stage of ``plan``; StageFailedCheck names the first that answers wrongly."""
    for stage, leader, expected in zip(plan.stages, leaders, expectations.answers()):
        layers = (stage.start, stage.end)
        hidden = expected.hidden
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
                seed=expectations.seed,
                ids=expected.ids.tolist(),
                hidden=raw,
                layers=layers,
            ),
        )
        reason = _judge(
            result, expected.answer, expected.scale, expectations.dtype, expectations.rows_alone
        )
        if reason:
            raise StageFailedCheck(stage.members(), f"layers [{stage.start},{stage.end}): {reason}")
        log.info(
            "stage %s [%d,%d) computed its probe as the coordinator does", leader.node_id, *layers
        )


def _judge(
    result: ProbeResult,
    expected: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
    rows_alone: bool,
) -> str:
    """Why ``result`` is not the stage's answer ("" when it is)."""
    if result.error:
        return f"it could not run the probe: {result.error}"
    try:
        got = digest.unpack(result.digest, 1, 1)[0, 0]
    except ValueError as exc:
        return f"its answer is malformed: {exc}"
    gap = digest.differs(got, expected, scale, dtype, rows_alone)
    return f"its answer is {gap:.0f}x the tolerance from the coordinator's" if gap > 1 else ""
