"""The C heap, tamed for the long-lived mesh processes (coordinator and nodes): glibc's malloc,
or the jemalloc or tcmalloc that ``serve`` and ``join`` preload (see seamline/allocator.py)."""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from collections.abc import Callable

M_ARENA_MAX = -8  # mallopt parameter (malloc.h)
TRIM_EVERY_S = 10.0
ALL_ARENAS = 4096  # jemalloc's MALLCTL_ARENAS_ALL: "arena.4096.<op>" acts on every arena
_trimming = threading.Event()


def tame_malloc() -> None:
    """Free memory handed back to the system every few seconds (and, on glibc, two arenas).

    glibc gives each thread that allocates its own arena (up to 8 per core), and memory freed
    in one is not reused by another: a process with a thread per connection would hold tens of
    MB it no longer uses. And KV buffers of many sizes, made and freed as requests come and go,
    leave free pages inside the heap that glibc keeps; ``malloc_trim`` returns them (a few ms,
    rarely), so a node's resident memory is what it holds. jemalloc returns pages unused for
    ten seconds, but only when it is called: an idle node would keep what a burst freed, so
    the same thread asks it to. tcmalloc returns free pages as it goes."""
    heap = _heap()
    if heap is None:
        return
    kind, lib = heap
    if kind == "glibc":
        lib.mallopt(M_ARENA_MAX, 2)
    periodic = {"glibc": lambda: lib.malloc_trim(0), "jemalloc": lambda: _mallctl(lib, "decay")}.get(kind)
    if periodic is not None and not _trimming.is_set():
        _trimming.set()
        threading.Thread(target=_trim_forever, args=(periodic,), daemon=True, name="seamline-trim").start()


def trim_now() -> None:
    """Hand free heap pages back at once: after a burst of buffers freed together (a speed
    probe's copied caches: hundreds of MB for a moment), not at the next periodic trim."""
    heap = _heap()
    if heap is None:
        return
    kind, lib = heap
    if kind == "jemalloc":
        _mallctl(lib, "purge")
    elif kind == "tcmalloc":
        lib.MallocExtension_ReleaseFreeMemory()
    else:
        lib.malloc_trim(0)


def _heap() -> tuple[str, ctypes.CDLL] | None:
    """Which allocator serves this process's malloc ("jemalloc", "tcmalloc" or "glibc"), and the
    library to call it through; None off Linux or on another C library."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(None)  # the global scope: a preloaded allocator's symbols come first
    except OSError:
        return None
    if hasattr(lib, "mallctl"):
        return "jemalloc", lib
    if hasattr(lib, "MallocExtension_ReleaseFreeMemory"):
        return "tcmalloc", lib
    if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim"):
        return "glibc", lib
    return None


def _mallctl(lib: ctypes.CDLL, operation: str) -> None:
    """jemalloc's ``arena.<all>.<operation>``: "decay" returns pages by its decay schedule,
    "purge" every unused page."""
    lib.mallctl(f"arena.{ALL_ARENAS}.{operation}".encode(), None, None, None, ctypes.c_size_t(0))


def _trim_forever(trim: Callable[[], object]) -> None:
    while True:
        time.sleep(TRIM_EVERY_S)
        trim()
