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
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_ARENA_MAX, 2)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    if not _trimming.is_set():
        _trimming.set()
        threading.Thread(target=_trim_forever, args=(trim,), daemon=True, name="seamline-trim").start()


def trim_now() -> None:
    """Hand free heap pages back at once: after a burst of buffers freed together (a speed
    probe's copied caches: hundreds of MB for a moment), not at the next periodic trim."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        return


def _trim_forever(trim: ctypes._CFuncPtr) -> None:  # type: ignore[name-defined]
    while True:
        time.sleep(TRIM_EVERY_S)
        trim(0)
