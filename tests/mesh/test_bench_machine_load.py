"""`bench throughput`'s account of foreign load: a busy process the bench watches is its own, one
it does not watch is foreign, whatever else the machine does at the time."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from seamline_bench.machine_load import Meter, machine_busy_s, wait_quiet

SPIN = "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end: pass"


def test_a_watched_process_is_own_and_an_unwatched_one_foreign() -> None:
    watched = subprocess.Popen([sys.executable, "-c", SPIN])
    other = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        time.sleep(0.3)  # both started
        both, only_watched = Meter(lambda: [watched.pid, other.pid]), Meter(lambda: [watched.pid])
        before = sum(psutil.Process(other.pid).cpu_times()[:2])
        began = time.monotonic()
        both.start()
        only_watched.start()
        time.sleep(2.0)
        without_other, with_other = both.stop(), only_watched.stop()
        other_share = (sum(psutil.Process(other.pid).cpu_times()[:2]) - before) / (
            (time.monotonic() - began) * (psutil.cpu_count() or 1)
        )
    finally:
        watched.wait()
        other.wait()
    assert other_share > 0.1  # it ran
    assert abs((with_other - without_other) - other_share) < 0.06, (
        with_other,
        without_other,
        other_share,
    )


def test_busy_time_grows_and_waiting_is_bounded() -> None:
    first = machine_busy_s()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    assert machine_busy_s() > first
    waited, share = wait_quiet(lambda: [], most_s=1.0, window_s=0.5)
    assert 0.5 <= waited <= 2.0 and 0.0 <= share <= 1.0
