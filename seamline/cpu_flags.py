"""Whether this process's quantized matmuls will take the torch path, told without importing torch.

A mesh node chooses its OpenMP spin (``runtime.openmp.node_spin``) before torch loads, and the
right spin depends on the path its steps take: the C++ kernels (``quant.native``) or the slower
torch path (``quant.matmul._tiled``). This module answers from the environment switch, the
machine and ``/proc/cpuinfo`` alone, as ``quant.native`` will decide it once torch is loaded.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

ENV_SWITCH = "SEAMLINE_QUANT_KERNELS"  # "0" turns the C++ kernels off (quant.native reads the same)
KERNEL_MACHINES = frozenset({"x86_64", "amd64"})
# what the kernels need of the CPU, every one in /proc/cpuinfo's flags line: their AVX-512 code
# as written, or (the least, KERNEL_FLAGS) the build that emulates it on AVX2
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})
KERNEL_FLAGS = frozenset({"avx2", "fma", "f16c", "bmi2"})
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first ``flags`` line's flags (every core lists the same); empty when there is none
    or the file cannot be read (not Linux)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def isa_of(flags: frozenset[str]) -> str | None:
    """The kernels' build a CPU with these flags runs: "avx512", "avx2" or None."""
    if AVX512_FLAGS | KERNEL_FLAGS <= flags:
        return "avx512"
    return "avx2" if KERNEL_FLAGS <= flags else None


def kernel_cpu(cpuinfo: Path = CPUINFO) -> bool:
    """Whether the CPU runs a build of the C++ kernels (it has every flag of ``KERNEL_FLAGS``)."""
    return isa_of(cpu_flags(cpuinfo)) is not None


def takes_torch_path(cpuinfo: Path = CPUINFO) -> bool:
    """Whether quantized matmuls here will go the torch path: the kernels switched off, a
    machine other than x86-64, or a CPU without what they need (a missing compiler is not
    looked for: ``quant.native`` warns of it, and a node that lacks one is set up wrong)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return True
    if platform.machine().lower() not in KERNEL_MACHINES:
        return True
    return not kernel_cpu(cpuinfo)
