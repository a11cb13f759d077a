"""A stage's speed probe taken again once its node is idle and its cores are quiet.

The probe a node takes as it loads its stage (``runtime.step_probe``) runs while the mesh is
still forming: its peers load, fetch fragments from it and probe on cores beside it, and on a
re-balance every member reloads at once, so a probe can read a third slower than the stage
steps. Once nothing has run on the stage for ``IDLE_S`` and other processes took less than
``QUIET_SHARE`` of its cores meanwhile, the node probes again, one forward at a time under the
worker's forward lock (a request that comes waits one probe forward at most), and keeps the
result if the stage stayed idle and its cores quiet throughout; else it waits and tries again.
It takes ``QUIET_PROBES`` such probes a while apart and keeps their median per row count.
A lockstep group is not probed again: its leader sees its own cores, not the other ranks'.
"""

from __future__ import annotations

import logging
import random
import statistics
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from seamline.mesh.arenas import trim_now
from seamline.mesh.node.core_load import others_cpu_seconds

if TYPE_CHECKING:
    from seamline.model.stage import Stage
    from seamline.runtime.stage_worker import StageWorker

log = logging.getLogger("seamline.node")
IDLE_S = 2.0  # nothing run on the stage for this long before it probes
QUIET_SHARE = 0.1  # of its cores' time other processes may take, before and while it probes
GIVE_UP_S = 900.0  # a node whose cores are never quiet keeps its loading probe
# quiet probes taken, a while apart, whose median per row count it keeps: a shared host's speed
# wanders over seconds, and one moment's probe can read 10-20% off the next's
QUIET_PROBES = 3
SPACING_S = 5.0


def reprobe_when_quiet(worker: StageWorker, stage: Stage, serving: Callable[[], bool]) -> None:
    """Start a thread that probes ``stage`` again when ``worker`` is idle and its cores are quiet,
    while ``serving()`` (the worker still serves this stage); it ends when it has, or gives up."""
    threading.Thread(
        target=_reprobe, args=(worker, stage, serving), name="seamline-reprobe", daemon=True
    ).start()


def _reprobe(worker: StageWorker, stage: Stage, serving: Callable[[], bool]) -> None:
    from seamline.runtime.step_probe import NotProbed

    deadline = time.monotonic() + GIVE_UP_S
    taken: list[tuple[dict[int, float], dict[int, float]]] = []
    while serving() and time.monotonic() < deadline:
        if _quiet_for(worker, IDLE_S):
            try:
                probed = _probe_if_quiet(worker, stage)
            except NotProbed:  # the loading probe could not run either: nothing to take again
                return
            if probed is not None and serving():
                taken.append(probed)
                if len(taken) == QUIET_PROBES:
                    worker.step_probe, worker.prompt_probe = _median(taken, 0), _median(taken, 1)
                    worker.probe_quiet = True
                    log.info(
                        "speed probe taken again on quiet cores: %s ms",
                        {rows: round(s * 1e3, 2) for rows, s in worker.step_probe.items()},
                    )
                    return
                time.sleep(SPACING_S)
        time.sleep(random.uniform(0.0, IDLE_S))  # nodes sharing a core do not all try at once


def _median(taken: list[tuple[dict[int, float], dict[int, float]]], kind: int) -> dict[int, float]:
    """Per row count, the median of the probes ``taken`` (``kind`` 0: steps, 1: prompts)."""
    return {
        rows: statistics.median(probe[kind][rows] for probe in taken) for rows in taken[0][kind]
    }


def _quiet_for(worker: StageWorker, seconds: float) -> bool:
    busy, others = worker.busy_seconds, others_cpu_seconds()
    time.sleep(seconds)
    return worker.busy_seconds == busy and others_cpu_seconds() - others < QUIET_SHARE * seconds


def _probe_if_quiet(
    worker: StageWorker, stage: Stage
) -> tuple[dict[int, float], dict[int, float]] | None:
    """The probe, if nothing else ran on the stage or took its cores while it ran."""
    from seamline.runtime.step_probe import probe_prompt, probe_steps

    busy, others, started = worker.busy_seconds, others_cpu_seconds(), time.monotonic()
    try:
        probed = (
            probe_steps(stage, lock=worker.forward_lock),
            probe_prompt(stage, lock=worker.forward_lock),
        )
    finally:
        trim_now()  # its copied caches, freed
    quiet = others_cpu_seconds() - others < QUIET_SHARE * (time.monotonic() - started)
    return probed if quiet and worker.busy_seconds == busy else None
