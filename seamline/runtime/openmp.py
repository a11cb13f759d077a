"""OpenMP worker pools: keep the thread that serves a model the only one in its process.

torch's CPU kernels (and seamline's C++ ones) run on libgomp, which gives every thread that
starts a parallel region a pool of workers of its own, kept until that thread ends. While a
process's pools hold no more threads than it has cores, a worker spins a few milliseconds
between two regions and the next one starts at once; once they hold more, libgomp throttles
every worker to sleep (a futex) after about a hundred spins. A decode step is a few hundred
short regions, so a throttled step wakes its workers a few hundred times: on 2 cores, +30-60%
per token, measured. That is what a server got by loading its model on one thread (the main
one, whose pool stays) and generating on another (the batch loop's): hence ``on_passing_thread``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


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
