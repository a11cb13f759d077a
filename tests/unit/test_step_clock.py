"""A stage thread's decode steps: their CPU outside their forwards (``runtime.step_clock``)."""

from __future__ import annotations

import time

from seamline.runtime.step_clock import StepClock


def burn(seconds: float) -> None:
    """Take ``seconds`` of this thread's CPU."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def cycle(clock: StepClock, outside_s: float, forwards: list[tuple[float, int | None]]) -> None:
    clock.begin()
    burn(outside_s)
    for seconds, decode_rows in forwards:
        burn(seconds)
        clock.forward(seconds, decode_rows)
    time.sleep(0.05)  # waiting takes no CPU: not counted
    clock.end()


def test_the_median_cpu_outside_the_forward_at_one_row_and_at_many() -> None:
    clock = StepClock(kept=3)
    assert clock.overhead_s() == {}
    cycle(clock, 0.05, [(0.01, None)])  # a step with a prompt chunk: not counted
    cycle(clock, 0.05, [])  # ran no forward
    cycle(clock, 0.05, [(0.01, 1), (0.01, 1)])  # two forwards in one cycle: not one step's
    cycle(clock, 0.05, [(0.01, 3)])  # neither few rows nor many
    assert clock.overhead_s() == {}
    for outside in (0.002, 0.004, 0.006, 0.05):  # the first falls out of the latest three
        cycle(clock, outside, [(0.01, 1)])
    one = clock.overhead_s()
    assert (
        set(one) == {1} and 0.006 <= one[1] < 0.03
    )  # the middle one: not the 0.05, nor the sleeps
    for rows, outside in ((8, 0.01), (16, 0.02), (32, 0.03)):
        cycle(clock, outside, [(0.01, rows)])
    many = clock.overhead_s()
    assert set(many) == {1, 16} and 0.02 <= many[16] < 0.03


def test_a_one_row_cycle_is_timed_whole_and_one_streams_ring_round_by_round() -> None:
    from seamline.runtime.step_clock import RingClock

    clock = StepClock()
    assert clock.cycle_wall_s() == 0.0
    cycle(clock, 0.002, [(0.01, 1)])  # the wall time includes the forward and the sleep
    assert 0.06 <= clock.cycle_wall_s() < 0.2
    ring = RingClock()
    ring.sent(alone=False)  # another row in flight: its token could be either's
    ring.returned()
    assert ring.ring_s() == 0.0
    ring.sent(alone=True)
    time.sleep(0.02)
    ring.returned()
    ring.returned()  # a token with no row timed out before it
    assert 0.02 <= ring.ring_s() < 0.2
