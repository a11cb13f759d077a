"""How much of a node's cores other work takes: what a probe taken again (``mesh.node.reprobe``)
needs to know its cores were quiet (no neighbour, coordinator or client on them).

Linux's ``/proc/stat`` counts every CPU's busy time by all processes; this process's own CPU
time taken off it leaves the others' (both read with psutil).
"""

from __future__ import annotations

import psutil


def others_cpu_seconds() -> float:
    """CPU seconds other processes took on this process's allowed CPUs since boot, per CPU
    (a share of one core's time); 0.0 where the system does not count them per CPU."""
    try:
        process = psutil.Process()
        cpus = process.cpu_affinity() or []
        per_cpu = psutil.cpu_times(percpu=True)
        own = process.cpu_times()
    except (AttributeError, psutil.Error, OSError):
        return 0.0
    busy = sum(_busy_s(per_cpu[i]) for i in cpus if i < len(per_cpu))
    return max(0.0, busy - own.user - own.system) / max(1, len(cpus))


def _busy_s(times: object) -> float:
    """A CPU's seconds spent on user, nice, system and interrupt work (not idle, iowait or steal)."""
    return sum(
        float(getattr(times, field, 0.0)) for field in ("user", "nice", "system", "irq", "softirq")
    )
