"""A loaded stage's speed probe (``runtime.step_probe``), taken once the stage is linked into
its route and idle, never before READY: a route waits for its stages to load and pass the
start-up check, not for a probe of several seconds per stage (two survivors probing in turn
held every recovery from a lost node some 15 s), and the probe does not take the cores the
start-up check computes on.

The probe runs one forward at a time under the worker's forward lock and gives way to serving:
before each forward it checks that the stage is still waiting for work, and when work came it
stops and starts again at the next idle moment, so a request waits one probe forward at most.
A stage that serves without a pause reports no probe until it pauses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from seamline.mesh.arenas import trim_now

if TYPE_CHECKING:
    from seamline.model.stage import Stage
    from seamline.runtime.group_stage import LockstepStage
    from seamline.runtime.stage_worker import StageWorker

log = logging.getLogger("seamline.node")
IDLE_S = 1.0  # nothing run on the stage for this long before it probes
# ...and a stage that has run nothing yet waits this long for its first rows: a later stage gets
# a new route's replayed requests only once stage 0 has computed their first chunks (a second or
# more under load), and a probe's forward begun just before they come holds them one forward
FIRST_WORK_S = 10.0
POLL_S = 0.25  # how often an idle stage is looked at while it serves


class GaveWay(Exception):
    """Work came while the stage probed: the probe stopped for it."""


class _UnlessWorkCame:
    """The worker's forward lock, taken for one probe forward only while the stage still waits
    for work (GaveWay otherwise)."""

    def __init__(self, worker: StageWorker) -> None:
        self.worker = worker

    def __enter__(self) -> None:
        self.worker.forward_lock.acquire()
        if self.worker.idle.waiting_for() == 0.0:
            self.worker.forward_lock.release()
            raise GaveWay()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.worker.forward_lock.release()


def probe_when_idle(
    worker: StageWorker,
    stage: Stage | LockstepStage,
    serving: Callable[[], bool],
    then: Callable[[], None] = lambda: None,
) -> None:
    """Start a thread that probes ``stage`` once ``worker`` is idle, while ``serving()`` (the
    worker still serves this stage), keeps the result on the worker and calls ``then()``."""
    threading.Thread(
        target=_probe_when_idle,
        args=(worker, stage, serving, then),
        name="seamline-speed-probe",
        daemon=True,
    ).start()


def _probe_when_idle(
    worker: StageWorker,
    stage: Stage | LockstepStage,
    serving: Callable[[], bool],
    then: Callable[[], None],
) -> None:
    from seamline.runtime.step_probe import NotProbed, probe_prompt, probe_steps

    lock = _UnlessWorkCame(worker)
    linked = time.monotonic()
    time.sleep(IDLE_S)  # the replayed requests of a new route come at once
    while serving():
        if _too_soon(worker, linked):
            time.sleep(POLL_S)
            continue
        try:
            probed = probe_steps(stage, lock=lock), probe_prompt(stage, lock=lock)
        except GaveWay:
            continue
        except NotProbed as exc:
            log.info("no speed probe: %s", exc)
            return
        except Exception as exc:  # a probe never stops a stage from serving
            log.warning("the stage's speed probe failed: %s", exc)
            return
        finally:
            trim_now()  # its copied caches, freed: the stage's memory is its share again
        if serving():
            worker.step_probe, worker.prompt_probe = probed
            then()
        return


def _too_soon(worker: StageWorker, linked: float) -> bool:
    """Whether the stage must wait before it probes: it ran something less than IDLE_S ago, or
    it has run nothing yet and its route was linked less than FIRST_WORK_S ago."""
    if worker.idle.waiting_for() < IDLE_S:
        return True
    return not worker.idle.has_worked() and time.monotonic() - linked < FIRST_WORK_S
