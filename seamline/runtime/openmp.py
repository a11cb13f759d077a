"""OpenMP worker pools: keep the thread that serves a model the only one in its process.

torch's CPU kernels (and seamline's C++ ones) run on libgomp, which gives every thread that
starts a parallel region a pool of workers of its own, kept until that thread ends. While a
process's pools hold no more threads than it has cores, a worker spins a few milliseconds
between two regions and the next one starts at once; once they hold more, libgomp throttles
every worker to sleep (a futex) after about a hundred spins. A decode step is a few hundred
short regions, so a throttled step wakes its workers a few hundred times: on 2 cores, +30-60%
per token, measured. That is what a server got by loading its model on one thread (the main
one, whose pool stays) and generating on another (the batch loop's): hence ``on_passing_thread``.

A spinning worker has its cost too: libgomp's default spin (about 300,000 pauses, some
milliseconds) outlasts a step, so after each step a mesh node's idle worker holds a core while
the next stage computes. Stages that share a machine then take each other's cores (a 2-stage
mesh on 2 cores ran at 0.55x one process, against 0.67x with its workers throttled), and a
node's steps are a link's round trip apart anyway: ``node_spin`` keeps them spinning through
a step's regions (tens of microseconds apart) but not between steps. On the torch path (no C++
kernels: ``seamline.cpu_flags``) a step's regions are further apart, Python dequantising a tile
between two, so its workers spin longer; its steps are tens of times longer too.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from seamline.cpu_flags import CPUINFO, takes_torch_path

T = TypeVar("T")
log = logging.getLogger(__name__)
SPIN_VARIABLE = "GOMP_SPINCOUNT"  # libgomp reads it once, as torch loads it
NODE_SPIN_COUNT = (
    5000  # pauses, a few hundred microseconds: longer than a step's gaps, far shorter than a step
)
# The torch path's gaps outlast 5000 pauses (~125 us at ~25 ns each): Python dequantises tiles
# between regions. Voluntary switches a token of the embedded model's 2-node mesh on 2 cores
# (measured): ~550 at 5000; at 50000 ~7, or 30-80 in a third of the runs (a stage's threads
# preempted by the other's); 5-8 in 19 runs at 200000, at the same ms a token. 200000 pauses
# are ~5 ms, a spin after a torch-path step of ~100 ms.
TORCH_PATH_SPIN_COUNT = 200000


def node_spin_count(cpuinfo: Path = CPUINFO) -> int:
    """The spin a mesh node's OpenMP workers get: longer where its matmuls take the torch path."""
    return TORCH_PATH_SPIN_COUNT if takes_torch_path(cpuinfo) else NODE_SPIN_COUNT


def node_spin() -> None:
    """A mesh node's OpenMP spin (``node_spin_count``), unless the user set one; before torch loads."""
    if SPIN_VARIABLE in os.environ:
        return
    count = node_spin_count()
    if "torch" in sys.modules:
        log.warning(
            "torch is loaded already: %s=%d comes too late to take effect", SPIN_VARIABLE, count
        )
        return
    os.environ[SPIN_VARIABLE] = str(count)


def on_passing_thread(work: Callable[[], T], name: str = "seamline-load") -> T:
    """``work()`` on a thread that ends when it returns; its result, or its exception, here.

    For torch work done once (loading, checking) on a thread that is not the one that will
    generate: the OpenMP pool it makes ends with its thread, so the generating thread's pool
    stays the only one and its workers spin between regions instead of sleeping."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
