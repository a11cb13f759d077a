"""A size-class allocator (jemalloc, else tcmalloc) for the long-lived processes, where one is installed.

With glibc's malloc a node slows down for good after a burst of large batches: the tensors of
64-row steps and the KV buffers of 64 sequences leave its heap in pieces, and a later step's
tensors are carved from all over it. Measured on one node in one process, 16-row decode steps
ran 2-17% slower (three runs) after four waves of 64 clients than before them, the time in allocation and
in first writes to the new tensors (their residual adds 4-6x slower); on a 2-rank lockstep group,
whose ranks allocate for every gate too, 16 clients streamed 25% slower, idle or not since.
jemalloc and tcmalloc reuse same-sized blocks, and the same waves left the group's steps as
they were. PyTorch's own CPU launcher (``torch.backends.xeon.run_cpu``) preloads them for the
same reason.

With ``SEAMLINE_MALLOC=jemalloc`` (or ``tcmalloc``), ``serve`` and ``join`` start again at once with
that library in ``LD_PRELOAD`` (their children, lockstep ranks among them, inherit it); a library
that is not installed is said, and glibc's malloc kept. Not by default (``system``): jemalloc
keeps the pages a request freed until the node idles (below), and a node's memory right after a
request exceeded what a stage may hold beyond its weights on a test mesh. install.sh installs
jemalloc where it may use apt.

jemalloc runs without its decay (``JEMALLOC_CONF``, unless the user set ``MALLOC_CONF``): with
any decay time it handed blocks of 16 MB and more back to the system as soon as they were
freed, so the K-quant path's dequantized weights (2.4 GB a 16-row step on a 1B model) were
faulted in afresh every step: 785 ms a step against glibc's 203 (206 without the decay). The
mesh processes hand free pages back when idle instead (``mesh.arenas``).
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Mapping

from seamline.errors import ConfigError

CHOICE = "SEAMLINE_MALLOC"
# its values -> the libraries each preloads, by ctypes.util.find_library names, preferred first
CHOICES = {"jemalloc": ("jemalloc",), "tcmalloc": ("tcmalloc_minimal", "tcmalloc"), "system": ()}
LIBRARIES = tuple(
    name for names in CHOICES.values() for name in names
)  # any of them preloaded: none again
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"  # freed pages stay for reuse (see above)


def chosen_libraries(env: Mapping[str, str]) -> tuple[str, ...]:
    """The libraries ``SEAMLINE_MALLOC`` in ``env`` asks for (none: unset or "system", glibc's
    malloc); a value not in ``CHOICES`` is a ``ConfigError`` that names them."""
    value = env.get(CHOICE, "").strip().lower() or "system"
    if value not in CHOICES:
        raise ConfigError(f"{CHOICE}={env[CHOICE]!r}: choose one of {', '.join(CHOICES)}")
    return CHOICES[value]


def installed_allocator(names: tuple[str, ...]) -> str | None:
    """The file name of the first of ``names`` the dynamic linker can find (None: none)."""
    for name in names:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def wants_preload(env: Mapping[str, str]) -> bool:
    """Whether a process with ``env`` should start again with an allocator preloaded: where the
    user chose one (``SEAMLINE_MALLOC``) and none of ``LIBRARIES`` is preloaded yet."""
    preloaded = env.get("LD_PRELOAD", "")
    return bool(chosen_libraries(env)) and not any(f"lib{name}." in preloaded for name in LIBRARIES)


def preload_env(env: Mapping[str, str], library: str | None) -> dict[str, str] | None:
    """``env`` with ``library`` first in ``LD_PRELOAD``, and jemalloc's ``JEMALLOC_CONF`` where
    the user set no ``MALLOC_CONF`` (None: nothing to change)."""
    if library is None or not wants_preload(env):
        return None
    preloaded = env.get("LD_PRELOAD", "")
    conf = (
        {"MALLOC_CONF": JEMALLOC_CONF} if "jemalloc" in library and "MALLOC_CONF" not in env else {}
    )
    return {**env, "LD_PRELOAD": f"{library}:{preloaded}" if preloaded else library, **conf}


def restart_with_allocator() -> None:
    """Run this very command again with the allocator ``SEAMLINE_MALLOC`` chose preloaded, where
    it is installed and not yet in use (on Linux); else return. Call it first thing, before any
    thread starts."""
    if not sys.platform.startswith("linux") or not wants_preload(os.environ):
        return  # before looking for the library: a restarted process does not look again
    library = installed_allocator(chosen_libraries(os.environ))
    if library is None:
        print(
            f"seamline: {CHOICE}={os.environ[CHOICE]}: not installed, running on glibc's malloc",
            file=sys.stderr,
        )
        return
    env = preload_env(os.environ, library)
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def allocator_in_use() -> str:
    """The allocator this process runs: a library of ``LIBRARIES`` mapped in it, else "glibc"."""
    try:
        with open("/proc/self/maps") as maps:
            mapped = maps.read()
    except OSError:
        return "unknown"
    return next((name for name in LIBRARIES if f"/lib{name}." in mapped), "glibc")
