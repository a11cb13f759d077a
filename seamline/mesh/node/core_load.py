"""How much of a node's cores other work takes: what a re-balance (``mesh.control.balance``)
needs to see a stage whose core also runs the coordinator, the clients or a neighbour.

A stage's busy seconds count its forwards' wall time; work that runs on its core between
forwards (an API on the same core, a load generator) leaves the stage idle yet slows the
pipeline all the same. Linux's ``/proc/stat`` counts every CPU's busy time by all processes;
this process's own CPU time taken off it leaves the others'.
"""

from __future__ import annotations

import os
import time

STAT = "/proc/stat"
BUSY_FIELDS = slice(1, 4)  # user, nice, system
IRQ_FIELDS = slice(6, 8)  # irq, softirq


def others_cpu_seconds() -> float:
    """CPU seconds other processes took on this process's allowed CPUs since boot, per CPU
    (a share of one core's time); 0.0 where the kernel does not count them."""
    try:
        cpus = os.sched_getaffinity(0)
        with open(STAT, encoding="ascii") as stat:
            lines = stat.read().splitlines()
    except (AttributeError, OSError):
        return 0.0
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = [0, *map(int, rest.split())]
            ticks += sum(fields[BUSY_FIELDS]) + sum(fields[IRQ_FIELDS])
    busy = ticks / os.sysconf("SC_CLK_TCK")
    return max(0.0, busy - time.process_time()) / max(1, len(cpus))
