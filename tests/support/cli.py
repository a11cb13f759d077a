"""The command line as a user runs it: a `seamline` process, and its one-line errors."""

from __future__ import annotations

import subprocess
import sys


def seamline(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "seamline.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_clean_error(proc: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("seamline: error:"), proc.stderr
    assert fragment in lines[0]
