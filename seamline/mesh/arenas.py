"""Fewer glibc malloc arenas for the long-lived mesh processes (coordinator and nodes)."""

from __future__ import annotations

import ctypes
import sys

M_ARENA_MAX = -8  # mallopt parameter (malloc.h)


def few_malloc_arenas() -> None:
    """glibc gives each thread that allocates its own malloc arena (up to 8 per core), and
    memory freed in one is not reused by another: a process with a thread per connection
    (readers, prompts, joins) would hold tens of MB it no longer uses. Two arenas keep it
    near what it holds."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).mallopt(M_ARENA_MAX, 2)
        except (OSError, AttributeError):  # not glibc
            pass
