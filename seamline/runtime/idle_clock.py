"""The seconds a stage had nothing to run: from when it began to wait for work to when work came.

A re-balance (``mesh.control.balance``) reads a stage's occupied seconds, the wall time less
these: its forwards, its own work between them, and the time it had work but its core was
running something else (the coordinator and the clients beside stage 0). Other processes' work
while the stage waits for work (the lull between two bursts of requests, or stage 0 waiting for
its tokens to come back) costs the pipeline nothing and is not counted.

Stage 0 stops its clock when work is posted to its driver, not when the driver wakes: a driver
woken late because its core was busy has waited for its core, not for work.
"""

from __future__ import annotations

import threading
import time


class IdleClock:
    """Idle from its creation until the first work (a stage loaded waits for its first rows)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0.0
        self._since: float | None = time.monotonic()
        self._worked = False

    def wait(self) -> None:
        """Nothing to run from now on (no-op while already waiting)."""
        with self._lock:
            if self._since is None:
                self._since = time.monotonic()

    def work(self) -> None:
        """Work came (no-op while not waiting)."""
        with self._lock:
            self._worked = True
            if self._since is not None:
                self._total += time.monotonic() - self._since
                self._since = None

    def has_worked(self) -> bool:
        """Whether any work has come since the clock was made (with its stage)."""
        with self._lock:
            return self._worked

    def seconds(self) -> float:
        """Idle seconds so far, the wait in progress included."""
        with self._lock:
            return self._total + (
                time.monotonic() - self._since if self._since is not None else 0.0
            )

    def waiting_for(self) -> float:
        """Seconds the wait in progress has lasted (0.0 while there is work)."""
        with self._lock:
            return time.monotonic() - self._since if self._since is not None else 0.0
