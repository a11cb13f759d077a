"""The size-class allocator that serve and join preload (seamline/allocator.py)."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

from seamline.allocator import LIBRARIES, OPT_OUT, installed_allocator, preload_env

# a program that restarts itself as serve and join do, then says which allocator it runs
RESTARTS = ("from seamline.allocator import restart_with_allocator, allocator_in_use\n"
            "restart_with_allocator()\nprint(allocator_in_use())")  # fmt: skip


def test_preload_env_puts_the_library_first_and_keeps_what_was_preloaded() -> None:
    assert preload_env({"PATH": "/bin"}, "libjemalloc.so.2") == {"PATH": "/bin", "LD_PRELOAD": "libjemalloc.so.2"}
    assert preload_env({"LD_PRELOAD": "libfoo.so"}, "libjemalloc.so.2") == {"LD_PRELOAD": "libjemalloc.so.2:libfoo.so"}


def test_preload_env_changes_nothing_without_a_library_by_choice_or_when_one_is_preloaded() -> None:
    assert preload_env({}, None) is None
    assert preload_env({OPT_OUT: "system"}, "libjemalloc.so.2") is None
    assert preload_env({OPT_OUT: "System"}, "libjemalloc.so.2") is None
    assert preload_env({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, "libjemalloc.so.2") is None
    assert preload_env({"LD_PRELOAD": "libjemalloc.so.2"}, "libjemalloc.so.2") is None


def _run(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", RESTARTS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", OPT_OUT)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc: Linux only")
def test_a_restarted_process_runs_the_installed_allocator_or_glibc_where_told() -> None:
    library = installed_allocator()
    assert library, "install.sh --test installs Debian's libjemalloc2 (neither jemalloc nor tcmalloc is here)"
    name = library.removeprefix("lib").split(".so")[0]
    assert _run(_plain_env()) == name  # the process started again, with the library mapped
    assert _run(_plain_env() | {OPT_OUT: "system"}) == "glibc"


# a program that fills 256 blocks of 1 MiB through malloc, frees them, calls trim_now and
# prints its resident MiB with the blocks held, freed, and trimmed
FREES = """
import ctypes, psutil
from seamline.mesh.arenas import _heap, trim_now
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
rss = lambda: psutil.Process().memory_info().rss >> 20
blocks = [libc.malloc(1 << 20) for _ in range(256)]
for block in blocks:
    ctypes.memset(block, 1, 1 << 20)
held = rss()
for block in blocks:
    libc.free(block)
freed = rss()
trim_now()
print(_heap()[0], held, freed, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc: Linux only")
def test_trim_now_hands_freed_memory_back_whichever_allocator_runs() -> None:
    libraries = [None, *filter(None, (ctypes.util.find_library(name) for name in LIBRARIES))]
    seen = set()
    for library in libraries:
        env = _plain_env() | ({"LD_PRELOAD": library} if library else {})
        out = subprocess.run([sys.executable, "-c", FREES], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        kind, held, freed, trimmed = out.stdout.split()
        seen.add(kind)
        assert int(held) - int(trimmed) >= 200, (library, out.stdout)  # of the 256 MiB freed
    assert {"glibc", "jemalloc"} <= seen, seen
