"""The CPU seconds a decode step spends on its stage's thread outside its forward: taking the
rows in, scheduling, sampling, coding and sending the frame. The speed probe
(``runtime.step_probe``) times forwards alone; the cost model (``seamline.sim``) adds this to
every step, as a node measures it while it serves: at one row and at many (sampling and
coding grow with the rows), a line through the two. CPU time, not wall time: other processes
on the core (the coordinator's API beside stage 0) are priced on their own.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

KEPT_STEPS = 128  # per kind of step, the latest ones' figures: the medians of these are reported
FEW_ROWS = 2  # steps of at most this many rows are one row's
MANY_ROWS = 4  # and of at least this many, many rows'


class StepClock:
    """One stage thread's cycle: ``begin`` when it takes work, ``forward`` with its forward's CPU
    seconds (``time.thread_time``), ``end`` when the output is handed on. A cycle whose forward
    was not decode rows alone (a prompt chunk's coding weighs with its rows), or that ran none
    or two, is not counted."""

    def __init__(self, kept: int = KEPT_STEPS) -> None:
        self._few: deque[float] = deque(maxlen=kept)  # seconds outside the forward
        self._many: deque[tuple[int, float]] = deque(maxlen=kept)  # (rows, seconds outside)
        self._few_wall: deque[float] = deque(
            maxlen=kept
        )  # a one-row cycle's wall seconds, forward included
        self._began: float | None = None
        self._began_wall = 0.0
        self._forwards: list[
            tuple[float, int | None]
        ] = []  # (seconds, decode rows; None: prompt rows too)

    def begin(self, counted: bool = True) -> None:
        """A cycle starts; one that also starts or ends requests is not a step's (``counted``)."""
        self._began, self._forwards = time.thread_time() if counted else None, []
        self._began_wall = time.perf_counter()

    def forward(self, seconds: float, decode_rows: int | None) -> None:
        self._forwards.append((seconds, decode_rows))

    def end(self) -> None:
        if (
            self._began is not None
            and len(self._forwards) == 1
            and (rows := self._forwards[0][1]) is not None
        ):
            outside = max(0.0, time.thread_time() - self._began - self._forwards[0][0])
            if rows <= FEW_ROWS:
                self._few.append(outside)
                self._few_wall.append(time.perf_counter() - self._began_wall)
            elif rows >= MANY_ROWS:
                self._many.append((rows, outside))
        self._began, self._forwards = None, []

    def cycle_wall_s(self) -> float:
        """The median wall seconds of a one-row cycle, from taking the row to handing it on (0:
        none yet): what a stage after the first adds to one stream's round of the ring."""
        return _median(self._few_wall)

    def overhead_s(self) -> dict[int, float]:
        """Rows -> the median seconds outside the forward: at one row, and at the median row
        count of the latest steps of many rows (either missing until such steps ran)."""
        many = list(self._many)
        found = {1: _median(self._few)} if self._few else {}
        if many:
            found[round(statistics.median(r for r, _ in many))] = statistics.median(
                s for _, s in many
            )
        return found


class RingClock:
    """Stage 0 of a pipeline serving one stream: the wall seconds from its row leaving stage 0
    to its token coming back, the later stages' cycles and every hop between them."""

    def __init__(self, kept: int = KEPT_STEPS) -> None:
        self._rounds: deque[float] = deque(maxlen=kept)
        self._sent: float | None = None

    def sent(self, alone: bool) -> None:
        """A one-row step left stage 0; ``alone``: the only row in flight (else not timed)."""
        self._sent = time.perf_counter() if alone else None

    def returned(self) -> None:
        if self._sent is not None:
            self._rounds.append(time.perf_counter() - self._sent)
            self._sent = None

    def ring_s(self) -> float:
        return _median(self._rounds)


def _median(seen: deque[float]) -> float:
    """The median of what a clock kept (0: nothing yet); a copy first, as another thread appends."""
    values = list(seen)
    return statistics.median(values) if values else 0.0
