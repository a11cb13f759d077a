"""The cost model's parts: how fast a device steps, what a stage reads, what a link costs.

Every figure is a probe's (a node's speed probe, a link's measured round trip and bandwidth) or
a published one; nothing is fitted to a run's tokens per second. A device is two measurements:

* ``bytes_per_second``: its rate reading weights for one row (one sequence's decode step);
* ``batched``: at a few row counts (the probe takes 1, 16, 32 and 64), the weight bytes times
  rows it gets through per second: a step of ``r`` rows over ``B`` weight bytes takes
  ``r * B / rate(r)``. Between probed counts the rate is interpolated linearly in log2(rows);
  past the largest it stays at that count's (the time grows with the rows);
* ``prompt``: the same for a step's prompt rows (the probe takes 32 and 128 rows of one prompt,
  and 512 rows of four).

Pure Python, no torch: the planner, the simulator and `seamline plan` use it on any machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from seamline.mesh.plan.types import LinkCost

TOKEN_ID_BYTES = 8  # per row on the return hop (the drawn token's id)
FRAME_HEADER_BYTES = 64  # a frame's header and its row records' fixed part
ROW_RECORD_BYTES = 48  # per row: request, span, hashes, flags


@dataclass(frozen=True)
class DeviceSpeed:
    """One device's measured (or published) speed."""

    bytes_per_second: float  # weight-streaming rate at one row
    batched: Mapping[int, float] = field(
        default_factory=dict
    )  # rows -> weight bytes x rows per second
    # Prompt rows' rates (a step's prompt rows -> weight bytes x rows per second: a chunk's rows
    # share its attention, and the matmuls gain with the step's rows); empty: priced as decode
    # rows are. One prompt row is a decode step's: from it to the fewest probed, the rate rises
    # as the batched one does.
    prompt: Mapping[int, float] = field(default_factory=dict)

    def rate(self, rows: int) -> float:
        """Weight bytes x rows per second at ``rows`` rows."""
        return _interpolated({1: self.bytes_per_second, **self.batched}, rows)

    def prompt_rate(self, rows: int) -> float:
        """Weight bytes x rows per second of a step of ``rows`` prompt rows."""
        return _interpolated({1: self.bytes_per_second, **self.prompt}, rows)

    def step_s(self, weight_bytes: float, rows: int, prompt_rows: int = 0) -> float:
        """Seconds for one step of ``rows`` rows over ``weight_bytes`` bytes of weights, of which
        ``prompt_rows`` are prompt chunks' (priced at ``prompt`` where it was probed). The rows
        of one step share its matmuls: a step with both kinds is all its rows at the prompt
        rate, and the decode rows' own extra (a sequence each, attending over its context) on top."""
        if rows <= 0 or weight_bytes <= 0:
            return 0.0
        if not self.prompt or not prompt_rows:
            return rows * weight_bytes / self.rate(rows)
        decode = rows - prompt_rows
        extra = (
            decode * weight_bytes * (1 / self.rate(decode) - 1 / self.prompt_rate(decode))
            if decode
            else 0.0
        )
        return rows * weight_bytes / self.prompt_rate(rows) + max(0.0, extra)


def _interpolated(rates: Mapping[int, float], rows: int) -> float:
    """The rate at ``rows`` from rates measured at a few row counts: linear in log2(rows) between
    them, the nearest's beyond them."""
    points = sorted((int(r), float(v)) for r, v in rates.items())
    if rows <= points[0][0]:
        return points[0][1]
    for (r0, v0), (r1, v1) in zip(points, points[1:]):
        if rows <= r1:
            share = (math.log2(rows) - math.log2(r0)) / (math.log2(r1) - math.log2(r0))
            return v0 + share * (v1 - v0)
    return points[-1][1]


@dataclass(frozen=True)
class StageCost:
    """One stage of a plan as the cost model sees it.

    ``read_bytes``: weight bytes read per row for one row (its layers' active bytes, the head's
    on the last stage). A Mixture-of-Experts stage also names its routed experts: of
    ``expert_bytes`` (all its routed experts' bytes), a step of r rows reads the experts at
    least one row picks, ``1 - (1 - k/E)^r`` of them in expectation (``experts`` E,
    ``experts_per_token`` k); its time is the larger of that read at the one-row rate and the
    rows' work at the batched rate.
    """

    name: str
    speed: DeviceSpeed
    read_bytes: float
    core_share: float = 1.0  # of its device's time it can count on (nodes sharing a core: 1/2)
    expert_bytes: float = 0.0
    experts: int = 0
    experts_per_token: int = 0
    frame_bytes_per_row: int = 0  # the hidden state it sends on, per row (0: it is the last stage)
    # A lockstep group: ``gates`` partial sums per step, each ``gate_bytes_per_row`` per row over ``gate_link``
    ranks: int = 1
    gates: int = 0
    gate_bytes_per_row: int = 0
    gate_link: LinkCost | None = None
    fails_at_s: float | None = None  # the simulator fails this stage's node then
    # rows -> a step's seconds outside its forward, as the node measures it serving (``runtime.step_clock``)
    step_overhead_s: Mapping[int, float] = field(default_factory=dict)

    def step_s(self, rows: int, prompt_rows: int = 0) -> float:
        """Seconds for a step of ``rows`` rows (``prompt_rows`` of them prompt chunks') on this
        stage, its share of its device counted."""
        if rows <= 0:
            return 0.0
        work = self.speed.step_s(self.read_bytes, rows, prompt_rows)
        if self.experts and self.expert_bytes:
            touched = 1.0 - (1.0 - self.experts_per_token / self.experts) ** rows
            union = (
                self.read_bytes
                - self.expert_bytes * self.experts_per_token / self.experts
                + self.expert_bytes * touched
            )
            work = max(work, union / self.speed.bytes_per_second)
        gates = (
            self.gates * self.gate_link.seconds(rows * self.gate_bytes_per_row)
            if self.gate_link
            else 0.0
        )
        return (work + self.overhead_s(rows)) / self.core_share + gates

    def overhead_s(self, rows: int) -> float:
        """A step's seconds outside its forward at ``rows`` rows: on the line through the
        measured points (a fixed part and one per row), or the one point measured."""
        points = sorted(self.step_overhead_s.items())
        if len(points) < 2:
            return points[0][1] if points else 0.0
        (r0, v0), (r1, v1) = points[0], points[-1]
        return max(0.0, v0 + (rows - r0) * (v1 - v0) / (r1 - r0))


def frame_bytes(rows: int, bytes_per_row: int) -> int:
    """A hidden-state frame of ``rows`` rows on the wire."""
    return FRAME_HEADER_BYTES + rows * (bytes_per_row + ROW_RECORD_BYTES)


def return_bytes(rows: int) -> int:
    """The drawn tokens going back to stage 0."""
    return FRAME_HEADER_BYTES + rows * (TOKEN_ID_BYTES + ROW_RECORD_BYTES)


@dataclass(frozen=True)
class FrontCost:
    """The coordinator's API, and the clients where they share stage 0's device: CPU seconds per
    streamed token and per request, taken from stage 0's core (0: they have their own)."""

    s_per_token: float = 0.0
    s_per_request: float = 0.0


@dataclass(frozen=True)
class Load:
    """A wave of clients that start together, each streaming one request."""

    clients: int
    prompt_tokens: int
    output_tokens: int
