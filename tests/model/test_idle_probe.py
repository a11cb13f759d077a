"""A stage's speed probe taken once it is linked and idle, not before it serves
(``mesh.node.idle_probe``), on a real stage of a random checkpoint: a stage with work is not
probed until it waits, a probe gives way when work comes, and a worker no longer serving the
stage is left alone.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from seamline.mesh.node import idle_probe
from seamline.runtime import step_probe
from seamline.runtime.stage_worker import StageWorker
from seamline.runtime.step_probe import PROBE_ROWS, PROMPT_ROWS
from seamline.weights.loader import load_stage, open_source
from tests.support.configs import checkpoint_folder


@pytest.fixture
def worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StageWorker:
    monkeypatch.setattr(idle_probe, "IDLE_S", 0.3)
    monkeypatch.setattr(idle_probe, "POLL_S", 0.05)
    stage = load_stage(open_source(checkpoint_folder("dense", tmp_path)))
    return StageWorker(stage, True, True)


def _eventually(condition: object, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_a_stage_with_work_is_probed_once_it_waits(worker: StageWorker) -> None:
    worker.idle.work()  # a route's replayed requests
    done = threading.Event()
    idle_probe.probe_when_idle(worker, worker.stage, lambda: True, done.set)
    time.sleep(1.5)
    assert not worker.step_probe and not done.is_set()
    worker.idle.wait()
    assert _eventually(done.is_set)
    assert set(worker.step_probe) == set(PROBE_ROWS) and all(
        s > 0 for s in worker.step_probe.values()
    )
    assert set(worker.prompt_probe) == set(PROMPT_ROWS)


def test_a_stage_that_has_run_nothing_waits_for_its_first_rows(
    worker: StageWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later stage of a new route idles while stage 0 computes the replayed requests' first
    chunks: it does not take that for a lull (a probe forward begun then held the replays)."""
    monkeypatch.setattr(idle_probe, "FIRST_WORK_S", 2.5)
    began: list[float] = []
    probe = step_probe.probe_steps

    def noted(*args: Any, **kwargs: Any) -> dict[int, float]:
        began.append(time.monotonic())
        return probe(*args, **kwargs)

    monkeypatch.setattr(step_probe, "probe_steps", noted)
    done = threading.Event()
    linked = time.monotonic()
    idle_probe.probe_when_idle(worker, worker.stage, lambda: True, done.set)
    assert _eventually(done.is_set)  # no rows came at all: an idle mesh's stage is probed
    assert began[0] - linked >= 2.5, began[0] - linked


def test_a_probe_forward_gives_way_to_work_that_came(worker: StageWorker) -> None:
    lock = idle_probe._UnlessWorkCame(worker)
    with lock:  # the stage waits: the probe's forward may run
        assert worker.forward_lock.locked()
    worker.idle.work()
    with pytest.raises(idle_probe.GaveWay):
        with lock:
            pass
    assert not worker.forward_lock.locked()  # the request's forward takes it at once


def test_a_worker_no_longer_serving_is_left_alone(worker: StageWorker) -> None:
    idle_probe.probe_when_idle(worker, worker.stage, lambda: False)
    time.sleep(1.0)
    assert not worker.step_probe
    assert not any(t.name == "seamline-speed-probe" and t.is_alive() for t in threading.enumerate())
