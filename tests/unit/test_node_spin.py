"""A mesh node's OpenMP spin (``runtime.openmp.node_spin``) follows the path its matmuls take.

The C++ kernels keep a step's OpenMP regions close together, so a short spin; the torch path
(kernels switched off, another machine, or a CPU without what they need) spaces them further
apart, so a longer one. All of it decided from ``/proc/cpuinfo`` before torch loads.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from seamline import cpu_flags
from seamline.cpu_flags import ENV_SWITCH, KERNEL_FLAGS, kernel_cpu, takes_torch_path
from seamline.runtime import openmp
from seamline.runtime.openmp import (
    NODE_SPIN_COUNT,
    SPIN_VARIABLE,
    TORCH_PATH_SPIN_COUNT,
    node_spin,
    node_spin_count,
)

BASE_FLAGS = ("fpu", "sse", "sse2", "avx")  # no AVX2: the kernels need KERNEL_FLAGS beside


def _cpuinfo(tmp_path: Path, flags: list[str] | None, cores: int = 2) -> Path:
    """A /proc/cpuinfo of ``cores`` processors with these flags (None: no flags line)."""
    blocks = []
    for core in range(cores):
        lines = [f"processor\t: {core}", "vendor_id\t: GenuineIntel", "model name\t: a test CPU"]
        if flags is not None:
            lines.append("flags\t\t: " + " ".join(flags))
        blocks.append("\n".join(lines))
    path = tmp_path / "cpuinfo"
    path.write_text("\n\n".join(blocks) + "\n")
    return path


@pytest.fixture
def on_x86(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    monkeypatch.setattr(cpu_flags.platform, "machine", lambda: "x86_64")


def test_a_cpu_with_every_kernel_flag_runs_the_kernels(tmp_path: Path) -> None:
    assert kernel_cpu(_cpuinfo(tmp_path, [*BASE_FLAGS, *sorted(KERNEL_FLAGS), "amx_int8"]))


@pytest.mark.parametrize("missing", sorted(KERNEL_FLAGS))
def test_a_cpu_lacking_one_flag_does_not(tmp_path: Path, missing: str) -> None:
    assert not kernel_cpu(_cpuinfo(tmp_path, [*BASE_FLAGS, *sorted(KERNEL_FLAGS - {missing})]))


def test_no_flags_line_or_no_file_means_no_kernels(tmp_path: Path) -> None:
    assert not kernel_cpu(_cpuinfo(tmp_path, None))
    assert not kernel_cpu(tmp_path / "absent")
    assert not kernel_cpu(tmp_path)  # a directory: unreadable as a file


@pytest.mark.usefixtures("on_x86")
def test_a_kernel_cpu_gets_the_short_spin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = _cpuinfo(tmp_path, [*BASE_FLAGS, *sorted(KERNEL_FLAGS)])
    assert not takes_torch_path(info) and node_spin_count(info) == NODE_SPIN_COUNT
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert node_spin_count(info) == NODE_SPIN_COUNT


@pytest.mark.usefixtures("on_x86")
def test_the_torch_path_gets_the_long_spin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel_info = _cpuinfo(tmp_path, [*BASE_FLAGS, *sorted(KERNEL_FLAGS)])
    older = tmp_path / "older"
    older.mkdir()
    assert (
        node_spin_count(_cpuinfo(older, list(BASE_FLAGS[:3]))) == TORCH_PATH_SPIN_COUNT
    )  # the CPU
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert (
        takes_torch_path(kernel_info) and node_spin_count(kernel_info) == TORCH_PATH_SPIN_COUNT
    )  # the switch
    monkeypatch.delenv(ENV_SWITCH)
    monkeypatch.setattr(cpu_flags.platform, "machine", lambda: "aarch64")
    assert node_spin_count(kernel_info) == TORCH_PATH_SPIN_COUNT  # the machine
    assert TORCH_PATH_SPIN_COUNT > NODE_SPIN_COUNT


def test_node_spin_writes_the_count_before_torch_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openmp, "node_spin_count", lambda: 12345)
    monkeypatch.delenv(SPIN_VARIABLE, raising=False)
    pytest.importorskip("torch")
    node_spin()  # torch is loaded: too late to take effect, nothing set
    assert SPIN_VARIABLE not in os.environ
    monkeypatch.delitem(sys.modules, "torch")  # as a node's process is before it imports torch
    node_spin()
    assert os.environ[SPIN_VARIABLE] == "12345"


def test_node_spin_keeps_the_users_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPIN_VARIABLE, "777")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    node_spin()
    assert os.environ[SPIN_VARIABLE] == "777"
