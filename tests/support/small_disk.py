"""A small file system (tmpfs) for tests of a full disk; the test is skipped where this process
may not mount one (mounting needs root: CI runs as root, so there it always runs)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_file_system(folder: Path, size: str = "8m") -> Iterator[Path]:
    """``folder`` (created) with a tmpfs of ``size`` mounted on it, unmounted after."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a small file system here: {mounted.stderr.decode(errors='replace').strip()}"
        )
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def grow(folder: Path, size: str) -> None:
    """Make room: the tmpfs at ``folder`` grows to ``size``."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True)
