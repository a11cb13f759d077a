"""A stage's speed probe taken again once it is idle and its cores are quiet
(``mesh.node.reprobe``), on a real stage of a random checkpoint.

The quiet threshold is lifted here (``QUIET_SHARE``: this test cannot make the machine quiet);
the stage's own activity is what the test drives: a stage that keeps stepping is not probed,
one that stops is, and a worker that no longer serves the stage is left alone.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from seamline.mesh.node import reprobe
from seamline.runtime.stage_worker import StageWorker
from seamline.runtime.step_probe import PROBE_ROWS, PROMPT_ROWS
from seamline.weights.loader import load_stage, open_source
from tests.support.configs import checkpoint_folder

LOADING_PROBE = dict.fromkeys(PROBE_ROWS, 9.0)  # seconds: a probe taken beside a peer's loading


@pytest.fixture
def worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StageWorker:
    monkeypatch.setattr(reprobe, "IDLE_S", 0.3)
    monkeypatch.setattr(reprobe, "QUIET_SHARE", 1.0)
    monkeypatch.setattr(reprobe, "SPACING_S", 0.1)
    stage = load_stage(open_source(checkpoint_folder("dense", tmp_path)))
    worker = StageWorker(stage, True, True)
    worker.step_probe, worker.prompt_probe = dict(LOADING_PROBE), dict.fromkeys(PROMPT_ROWS, 9.0)
    return worker


def wait_for(condition: object, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_a_stage_that_keeps_stepping_is_probed_once_it_stops(worker: StageWorker) -> None:
    stop = threading.Event()

    def stepping() -> None:  # the stage's forwards, as run_batch counts them
        while not stop.is_set():
            worker.busy_seconds += 0.01
            time.sleep(0.05)

    threading.Thread(target=stepping, daemon=True).start()
    reprobe.reprobe_when_quiet(worker, worker.stage, lambda: True)
    time.sleep(2.0)
    assert not worker.probe_quiet and worker.step_probe == LOADING_PROBE
    stop.set()
    assert wait_for(lambda: worker.probe_quiet)
    assert set(worker.step_probe) == set(LOADING_PROBE) and all(
        0 < s < 9.0 for s in worker.step_probe.values()
    )
    assert set(worker.prompt_probe) == set(PROMPT_ROWS) and all(
        0 < s < 9.0 for s in worker.prompt_probe.values()
    )


def test_a_worker_no_longer_serving_is_left_alone(worker: StageWorker) -> None:
    reprobe.reprobe_when_quiet(worker, worker.stage, lambda: False)
    time.sleep(1.0)
    assert not worker.probe_quiet and worker.step_probe == LOADING_PROBE
    assert not any(t.name == "seamline-reprobe" and t.is_alive() for t in threading.enumerate())


def test_the_probes_kept_are_the_median_of_the_quiet_ones_taken() -> None:
    taken = [
        ({1: 3.0, 16: 9.0}, {32: 1.0}),
        ({1: 1.0, 16: 8.0}, {32: 5.0}),
        ({1: 2.0, 16: 30.0}, {32: 2.0}),
    ]
    assert reprobe._median(taken, 0) == {1: 2.0, 16: 9.0} and reprobe._median(taken, 1) == {32: 2.0}
