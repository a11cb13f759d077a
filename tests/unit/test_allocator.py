"""The size-class allocator that serve and join preload (seamline/allocator.py)."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

from seamline.allocator import (
    CHOICE,
    CHOICES,
    JEMALLOC_CONF,
    LIBRARIES,
    chosen_libraries,
    installed_allocator,
    preload_env,
)
from seamline.errors import ConfigError

# a program that restarts itself as serve and join do, then says which allocator it runs
RESTARTS = (
    "from seamline.allocator import restart_with_allocator, allocator_in_use\n"
    "restart_with_allocator()\nprint(allocator_in_use())"
)


def test_preload_env_puts_the_library_first_and_keeps_what_was_preloaded() -> None:
    tcmalloc = "libtcmalloc_minimal.so.4"
    chosen = {CHOICE: "jemalloc"}
    assert preload_env(chosen | {"PATH": "/bin"}, tcmalloc) == chosen | {
        "PATH": "/bin",
        "LD_PRELOAD": tcmalloc,
    }
    first = preload_env(chosen | {"LD_PRELOAD": "libfoo.so"}, tcmalloc)
    assert first == chosen | {"LD_PRELOAD": f"{tcmalloc}:libfoo.so"}


def test_preload_env_runs_jemalloc_without_its_decay_unless_the_user_configured_it() -> None:
    chosen = {CHOICE: "jemalloc"}
    expected = chosen | {"LD_PRELOAD": "libjemalloc.so.2", "MALLOC_CONF": JEMALLOC_CONF}
    assert preload_env(chosen, "libjemalloc.so.2") == expected
    mine = chosen | {"MALLOC_CONF": "narenas:2"}
    assert preload_env(mine, "libjemalloc.so.2") == {**mine, "LD_PRELOAD": "libjemalloc.so.2"}


def test_preload_env_changes_nothing_without_a_library_by_choice_or_when_one_is_preloaded() -> None:
    assert preload_env({}, "libjemalloc.so.2") is None  # glibc's unless chosen
    assert preload_env({CHOICE: "jemalloc"}, None) is None
    assert preload_env({CHOICE: "system"}, "libjemalloc.so.2") is None
    assert preload_env({CHOICE: "JEMALLOC"}, "libjemalloc.so.2") is not None
    tcmalloc = "/usr/lib/libtcmalloc_minimal.so.4"
    assert preload_env({CHOICE: "jemalloc", "LD_PRELOAD": tcmalloc}, "libjemalloc.so.2") is None
    assert (
        preload_env({CHOICE: "jemalloc", "LD_PRELOAD": "libjemalloc.so.2"}, "libjemalloc.so.2")
        is None
    )


def test_seamline_malloc_names_the_library_it_preloads_and_refuses_what_it_does_not_know() -> None:
    assert (
        chosen_libraries({})
        == chosen_libraries({CHOICE: "system"})
        == chosen_libraries({CHOICE: " "})
        == ()
    )
    assert chosen_libraries({CHOICE: "JEMALLOC"}) == ("jemalloc",)  # never tcmalloc in its place
    assert chosen_libraries({CHOICE: "tcmalloc"}) == ("tcmalloc_minimal", "tcmalloc")
    with pytest.raises(
        ConfigError, match="SEAMLINE_MALLOC='mimalloc': choose one of jemalloc, tcmalloc, system"
    ):
        chosen_libraries({CHOICE: "mimalloc"})


def test_serve_with_an_unknown_allocator_says_so_and_starts_nothing() -> None:
    env = _plain_env() | {CHOICE: "mimalloc"}
    out = subprocess.run(
        [sys.executable, "-m", "seamline.cli", "serve", "--single"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert (
        out.stderr.strip()
        == "seamline: error: SEAMLINE_MALLOC='mimalloc': choose one of jemalloc, tcmalloc, system"
    )


def _run(env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", RESTARTS], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", CHOICE)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc: Linux only")
def test_a_restarted_process_runs_the_installed_allocator_or_glibc_where_told() -> None:
    library = installed_allocator(
        CHOICES["jemalloc"]
    )  # jemalloc itself: never tcmalloc in its place
    assert library, "install.sh --test installs Debian's libjemalloc2 (jemalloc is not here)"
    name = library.removeprefix("lib").split(".so")[0]
    assert (
        _run(_plain_env() | {CHOICE: "jemalloc"}) == name
    )  # the process started again, with the library mapped
    assert _run(_plain_env()) == "glibc"


# what the programs below share: malloc and free through ctypes, 256 blocks of 1 MiB filled
# (``fill``) and freed (``release``), the resident MiB (``rss``)
HEAP = """
import ctypes, psutil
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
rss = lambda: psutil.Process().memory_info().rss >> 20
def fill():
    blocks = [libc.malloc(1 << 20) for _ in range(256)]
    for block in blocks:
        ctypes.memset(block, 1, 1 << 20)
    return blocks
def release(blocks):
    for block in blocks:
        libc.free(block)
"""
# a program that fills 256 blocks of 1 MiB through malloc, frees them, calls trim_now and
# prints its resident MiB with the blocks held, freed, and trimmed
FREES = (
    HEAP
    + """
from seamline.mesh.arenas import _heap, trim_now
blocks = fill()
held = rss()
release(blocks)
freed = rss()
trim_now()
print(_heap()[0], held, freed, rss())
"""
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc: Linux only")
def test_trim_now_hands_freed_memory_back_whichever_allocator_runs() -> None:
    libraries = [None, *filter(None, (ctypes.util.find_library(name) for name in LIBRARIES))]
    seen = set()
    for library in libraries:
        env = _plain_env() | ({"LD_PRELOAD": library} if library else {})
        out = subprocess.run(
            [sys.executable, "-c", FREES], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        kind, held, freed, trimmed = out.stdout.split()
        seen.add(kind)
        assert int(held) - int(trimmed) >= 200, (library, out.stdout)  # of the 256 MiB freed
    assert {"glibc", "jemalloc"} <= seen, seen


# a program that takes and frees a 16 MiB block 20 times and prints the page faults of each
# time after the first, and the block's pages
REUSES = """
import ctypes, resource
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def once():
    block = libc.malloc(16 << 20)
    ctypes.memset(block, 1, 16 << 20)
    libc.free(block)
once()
before = faults()
for _ in range(20):
    once()
print((faults() - before) // 20, (16 << 20) // resource.getpagesize())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc: Linux only")
def test_a_large_block_freed_is_reused_not_faulted_in_again_under_the_preloaded_allocator() -> None:
    # with jemalloc's default decay each 16 MiB block came back from the system, every page faulted in
    env = preload_env(_plain_env() | {CHOICE: "jemalloc"}, installed_allocator(CHOICES["jemalloc"]))
    assert env is not None
    out = subprocess.run(
        [sys.executable, "-c", REUSES], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    faults, pages = map(int, out.stdout.split())
    assert faults < pages // 20, (env["LD_PRELOAD"], faults, pages)


# under jemalloc: 256 MiB freed, then the periodic trim called three times (256 large blocks
# taken and freed before the second); prints the resident MiB before the trims and after each
IDLE = (
    HEAP
    + """
from seamline.mesh.arenas import _purge_when_idle
release(fill())
trim, seen = _purge_when_idle(libc), [rss()]
trim()
seen.append(rss())
release(fill())
trim()
seen.append(rss())
trim()
seen.append(rss())
print(*seen)
"""
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc: Linux only")
def test_jemalloc_hands_free_pages_back_once_next_to_no_large_block_was_taken_between_trims() -> (
    None
):
    library = ctypes.util.find_library("jemalloc")
    assert library, "install.sh --test installs Debian's libjemalloc2"
    env = preload_env(_plain_env() | {CHOICE: "jemalloc"}, library)
    assert env is not None
    out = subprocess.run(
        [sys.executable, "-c", IDLE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    freed, first, busy, idle = map(int, out.stdout.split())
    assert first >= freed - 16 and busy >= freed - 16, (
        out.stdout
    )  # the first trim, and 256 blocks since: kept
    assert idle <= freed - 200, out.stdout  # next to none since: the 256 MiB handed back
