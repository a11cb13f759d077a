"""How long a member that failed waits before it is planned again (``Coordinator.back_off``).

A member taken for lost, or that reported its own stage failed, may rejoin at once; planned
straight back in, one that keeps failing makes the mesh re-plan again and again. So each
failure of a planned member puts it out of planning for a time that doubles with every failure
(``FIRST_WAIT_S``, ``FIRST_WAIT_S * 2``, ... up to ``MOST_WAIT_S``); the count starts over
once it has gone ``SERVED_WELL_S`` past its last wait without failing. The first wait is long
enough that a member failing as soon as it serves makes at most three re-plans a minute: its
loss, its plan back in, its loss again, and the next wait is a minute.

A plan that cannot be made without members still waiting takes them in anyway: a mesh that
serves with a doubtful member beats one that does not serve.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from seamline.mesh.control.node_handle import NodeHandle

log = logging.getLogger("seamline.coordinator")
FIRST_WAIT_S = 30.0
MOST_WAIT_S = 600.0
SERVED_WELL_S = 120.0
Member = TypeVar("Member", bound="NodeHandle")


@dataclass
class Strikes:
    """A member's failures in a row, and when its present wait ends (``time.monotonic``)."""

    count: int = 0
    until: float = 0.0


class BackOff:
    """The members waiting to be planned again; ``over`` is called as each wait ends."""

    def __init__(
        self, over: Callable[[], None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.over, self.clock = over, clock
        self._strikes: dict[str, Strikes] = {}
        self._lock = threading.Lock()

    def strike(self, node_id: str, reason: str) -> float:
        """``node_id`` failed (``reason``): the seconds it now waits before it is planned again."""
        now = self.clock()
        with self._lock:
            strikes = self._strikes.setdefault(node_id, Strikes())
            if strikes.count and now - strikes.until >= SERVED_WELL_S:
                strikes.count = 0  # it served well since its last wait: a first failure again
            strikes.count += 1
            wait = min(MOST_WAIT_S, FIRST_WAIT_S * 2 ** (strikes.count - 1))
            strikes.until = now + wait
            count = strikes.count
        log.warning(
            "node %s failed (%s; failure %d in a row): it is planned again in %.0f s, at %s UTC",
            node_id,
            reason,
            count,
            wait,
            time.strftime("%H:%M:%S", time.gmtime(time.time() + wait)),
        )
        timer = threading.Timer(wait, self.over)
        timer.daemon = True
        timer.start()
        return wait

    def waiting_s(self, node_id: str) -> float:
        """The seconds ``node_id`` still waits before it may be planned (0: none)."""
        with self._lock:
            strikes = self._strikes.get(node_id)
        return max(0.0, strikes.until - self.clock()) if strikes is not None else 0.0

    def waiting(self) -> dict[str, float]:
        """Each member still waiting, and the seconds it has left (``/api/status``)."""
        with self._lock:
            nodes = list(self._strikes)
        left = {node: round(self.waiting_s(node), 1) for node in nodes}
        return {node: seconds for node, seconds in left.items() if seconds > 0}

    def ready(self, members: Iterable[Member]) -> list[Member]:
        """The members that wait for nothing."""
        return [m for m in members if self.waiting_s(m.node_id) == 0.0]
