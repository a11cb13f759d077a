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
# fewer large blocks (16 KiB and more) than this between two trims: idle (a heartbeat's frames
# take a few; a serving stage's steps take several each, tens of steps a second)
IDLE_LARGE_BLOCKS = 100
ALL_ARENAS = 4096  # jemalloc's MALLCTL_ARENAS_ALL: "arena.4096.<op>" acts on every arena
_trimming = threading.Event()


def tame_malloc() -> None:
    """Free memory handed back to the system every few seconds (and, on glibc, two arenas).

    glibc gives each thread that allocates its own arena (up to 8 per core), and memory freed
    in one is not reused by another: a process with a thread per connection would hold tens of
    MB it no longer uses. And KV buffers of many sizes, made and freed as requests come and go,
    leave free pages inside the heap that glibc keeps; ``malloc_trim`` returns them (a few ms,
    rarely), so a node's resident memory is what it holds. jemalloc runs without its own decay
    (``allocator.JEMALLOC_CONF``): the same thread has it return its free pages once no large
    block was allocated for ten seconds (next to none), so a serving node keeps the pages its
    steps reuse.
    tcmalloc returns free pages as it goes."""
    heap = _heap()
    if heap is None:
        return
    kind, lib = heap
    if kind == "glibc":
        lib.mallopt(M_ARENA_MAX, 2)
    periodic = {"glibc": lambda: lib.malloc_trim(0), "jemalloc": _purge_when_idle(lib)}.get(kind)
    if periodic is not None and not _trimming.is_set():
        _trimming.set()
        threading.Thread(
            target=_trim_forever, args=(periodic,), daemon=True, name="seamline-trim"
        ).start()


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
    """jemalloc's ``arena.<all>.<operation>`` ("purge": return every unused page)."""
    lib.mallctl(f"arena.{ALL_ARENAS}.{operation}".encode(), None, None, None, ctypes.c_size_t(0))


def _purge_when_idle(lib: ctypes.CDLL) -> Callable[[], None]:
    """A periodic trim for jemalloc: purge where fewer than ``IDLE_LARGE_BLOCKS`` large blocks
    were allocated since the last call (every call where its statistics cannot be read)."""
    last: list[int | None] = [None]

    def trim() -> None:
        count = _large_allocations(lib)
        if count is None or (last[0] is not None and count - last[0] < IDLE_LARGE_BLOCKS):
            _mallctl(lib, "purge")
        last[0] = count

    return trim


def _large_allocations(lib: ctypes.CDLL) -> int | None:
    """How many large blocks (16 KiB and more) jemalloc has handed out in this process."""
    epoch, count, size = ctypes.c_uint64(1), ctypes.c_uint64(), ctypes.c_size_t(8)
    if (
        lib.mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.c_size_t(8)) != 0
    ):  # refreshes the statistics
        return None
    name = f"stats.arenas.{ALL_ARENAS}.large.nmalloc".encode()
    if lib.mallctl(name, ctypes.byref(count), ctypes.byref(size), None, ctypes.c_size_t(0)) != 0:
        return None
    return count.value


def _trim_forever(trim: Callable[[], object]) -> None:
    while True:
        time.sleep(TRIM_EVERY_S)
        trim()
