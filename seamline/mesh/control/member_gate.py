"""What the coordinator takes from a member's word about requests: tokens, and reports that end one.

A request's tokens come from the stage that draws them: the current plan's last stage (a
lockstep group's leader). Only that stage or stage 0 may end a request (its own fault, or too
busy); another planned member's failure report replays it instead. A member's word on anything
else is refused: counted per node (``/api/status`` shows the counts), and logged at most once
per node and reason every ``REFUSAL_LOG_S``, since a member can repeat it as fast as it likes.
"""

from __future__ import annotations

import logging
import threading
import time

from seamline.mesh.plan.types import Plan

log = logging.getLogger("seamline.coordinator")
REFUSAL_LOG_S = 10.0


def drawer(plan: Plan | None) -> str:
    """The node that draws ``plan``'s tokens ("" without a plan)."""
    return plan.stages[-1].node_id if plan is not None and plan.stages else ""


def may_end(plan: Plan | None, node_id: str) -> bool:
    """Whether ``node_id`` may end a request on ``plan``: stage 0 admits it, the drawing stage draws it."""
    return (
        plan is not None and bool(plan.stages) and node_id in (plan.stages[0].node_id, drawer(plan))
    )


def serves(plan: Plan | None, node_id: str) -> bool:
    """Whether ``node_id`` has a part in ``plan`` (any rank of any stage)."""
    return plan is not None and any(node_id in s.members() for s in plan.stages)


class Refusals:
    """Frames and reports refused, by node; a reason logged at most once per ``REFUSAL_LOG_S``."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._logged: dict[tuple[str, str], float] = {}  # reasons are fixed texts: this stays small
        self._lock = threading.Lock()

    def refuse(
        self, node_id: str, reason: str, count: int = 1, level: int = logging.WARNING
    ) -> None:
        now = time.monotonic()
        with self._lock:
            total = self.counts[node_id] = self.counts.get(node_id, 0) + count
            last = self._logged.get((node_id, reason))
            if last is not None and now - last < REFUSAL_LOG_S:
                return
            self._logged[(node_id, reason)] = now
        log.log(
            level, "refused from node %s: %s (%d refused from it so far)", node_id, reason, total
        )


class Opened:
    """What a stage's word that a request is invalid is judged by. The API validated every
    request (its sampling, its prompt against the context); what it could not judge is stage 0's
    room for it (said as stage 0 admits it, before its first token) and a grammar (the drawing
    stage's, or stage 0's). A report that the request is at fault on anything else is the
    reporting stage's failure."""

    def __init__(self) -> None:
        self._requests: dict[int, tuple[bool, bool]] = {}  # in flight: (has a grammar, drew)
        self._lock = threading.Lock()

    def opened(self, request: int, grammar: bool) -> None:
        with self._lock:
            self._requests[request] = (grammar, False)

    def drew(self, requests: list[int]) -> None:
        with self._lock:
            for request in requests:
                if request in self._requests:
                    self._requests[request] = (self._requests[request][0], True)

    def closed(self, request: int) -> None:
        with self._lock:
            self._requests.pop(request, None)

    def may_be_invalid(self, plan: Plan | None, node_id: str, request: int) -> bool:
        """Whether ``node_id`` (stage 0 or the drawing stage) may find ``request`` at fault."""
        with self._lock:
            grammar, drew = self._requests.get(request, (False, False))
        stage0 = plan is not None and bool(plan.stages) and plan.stages[0].node_id == node_id
        return grammar or (stage0 and not drew)
