"""glibc malloc, tamed for the long-lived mesh processes (coordinator and nodes)."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

M_ARENA_MAX = -8  # mallopt parameter (malloc.h)
TRIM_EVERY_S = 10.0
_trimming = threading.Event()


def tame_malloc() -> None:
    """Two arenas, and free memory handed back to the system every few seconds.

    glibc gives each thread that allocates its own arena (up to 8 per core), and memory freed
    in one is not reused by another: a process with a thread per connection would hold tens of
    MB it no longer uses. And KV buffers of many sizes, made and freed as requests come and go,
    leave free pages inside the heap that glibc keeps; ``malloc_trim`` returns them (a few ms,
    rarely), so a node's resident memory is what it holds."""
    libc = _glibc()
    if libc is None:
        return
    libc.mallopt(M_ARENA_MAX, 2)
    trim = libc.malloc_trim
    if not _trimming.is_set():
        _trimming.set()
        threading.Thread(target=_trim_forever, args=(trim,), daemon=True, name="seamline-trim").start()


def trim_now() -> None:
    """Hand free heap pages back at once: after a burst of buffers freed together (a speed
    probe's copied caches: hundreds of MB for a moment), not at the next periodic trim."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    """This process's C library where it is glibc (with ``mallopt`` and ``malloc_trim``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 (present on glibc only)
    except (OSError, AttributeError):  # not glibc
        return None
    return libc


def _trim_forever(trim: ctypes._CFuncPtr) -> None:  # type: ignore[name-defined]
    while True:
        time.sleep(TRIM_EVERY_S)
        trim(0)
