"""A measured party in its own process, asked for one measurement at a time over stdin/stdout.

The driver module (``seamline_bench.split_driver``, ``seamline_bench.lockstep_driver``)
prints one JSON line when ready, then one per ``measure TOKENS`` line; ``quit`` ends it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from typing import IO, Any


class Driver:
    def __init__(
        self,
        module: str,
        args: list[str],
        prefix: list[str] | None = None,
        stderr: IO[str] | None = None,
    ) -> None:
        """Start ``python -m module *args`` (behind ``prefix``, e.g. ``ip netns exec NS``);
        it gets ready in the background until ``wait_ready``. ``stderr``: where its log goes."""
        self.module = module
        cmd = [*(prefix or []), sys.executable, "-m", module, *args]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
        self.ready: dict[str, Any] | None = None

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.module} exited with {self.proc.wait()}")
        return dict(json.loads(line))

    def wait_ready(self) -> dict[str, Any]:
        if self.ready is None:
            self.ready = self._line()
        return self.ready

    def ask(self, command: str) -> dict[str, Any]:
        """Send one command line; its JSON answer."""
        assert self.proc.stdin is not None
        self.wait_ready()
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def measure(self, tokens: int) -> dict[str, Any]:
        """One run of ``tokens`` decode steps: the driver's JSON for it."""
        self.start(tokens)
        return self._line()

    def start(self, tokens: int) -> None:
        """Begin a run without waiting for it (``result`` reads it): drivers run side by side."""
        assert self.proc.stdin is not None
        self.wait_ready()
        self.proc.stdin.write(f"measure {tokens}\n")
        self.proc.stdin.flush()

    def result(self) -> dict[str, Any]:
        return self._line()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in runs)
