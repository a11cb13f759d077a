"""How much of the machine's CPU went to processes outside a benchmark while it measured.

A figure measured while another process holds a core says little, and says least of llama.cpp:
its threads meet at a spinning barrier, and with one other busy process on this 2-core machine
its 2-thread decode fell from about 120 tok/s to under 1 (a 1-thread run kept 44). ``Meter``
reads the machine's busy CPU time (``/proc/stat``; time stolen by the hypervisor counts as
busy) and the benchmark's own (this process, its children once waited for, and the processes
``pids`` names, with their descendants) at ``start`` and ``stop``; the rest is foreign.
``wait_quiet`` waits, within a bound, for a moment when little of it is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import psutil

QUIET_SHARE = 0.1  # foreign CPU under this share of all cores is a quiet machine


def machine_busy_s() -> float:
    """CPU seconds all cores have spent not idle since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = (
        sum(fields[:8]) - idle
    )  # user nice system idle iowait irq softirq steal (guest is in user)
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_s(pids: list[int]) -> float:
    """CPU seconds of this process, its waited children, and each of ``pids`` with descendants."""
    mine = psutil.Process().cpu_times()
    total = mine.user + mine.system + mine.children_user + mine.children_system
    seen: set[int] = {os.getpid()}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue  # gone: its time is lost to both sides alike
        for proc in tree:
            if proc.pid in seen:
                continue
            seen.add(proc.pid)
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
    return total


class Meter:
    """Foreign CPU share between ``start`` and ``stop``."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.pids = pids
        self.began = (0.0, 0.0, 0.0)  # wall, machine busy, own

    def start(self) -> None:
        self.began = (time.monotonic(), machine_busy_s(), own_cpu_s(self.pids()))

    def stop(self) -> float:
        """The share of all cores (0 to 1) that processes outside the benchmark used."""
        wall, busy, own = time.monotonic(), machine_busy_s(), own_cpu_s(self.pids())
        foreign = (busy - self.began[1]) - (own - self.began[2])
        return round(
            max(0.0, foreign) / max(1e-9, (wall - self.began[0]) * (os.cpu_count() or 1)), 3
        )


def wait_quiet(
    pids: Callable[[], list[int]], most_s: float, window_s: float = 2.0
) -> tuple[float, float]:
    """Wait until a ``window_s`` with a foreign share under ``QUIET_SHARE``, at most ``most_s``:
    (seconds waited, the last window's share)."""
    meter, began = Meter(pids), time.monotonic()
    while True:
        meter.start()
        time.sleep(window_s)
        share = meter.stop()
        waited = time.monotonic() - began
        if share < QUIET_SHARE or waited >= most_s:
            return round(waited, 1), share
