"""The C++ kernels are AVX-512 code: a CPU with AVX-512 VNNI runs them as written, one with
only AVX2 (an AMD EPYC before Zen 4, say) the build that emulates them on 256-bit registers,
and any other must never load either (it dies of an illegal instruction): the torch path."""

from __future__ import annotations

from pathlib import Path

from seamline.quant.native import kernel_isa

AVX2_ONLY = "flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2\n"
VNNI = "flags\t\t: fpu sse2 avx avx2 fma f16c bmi2 avx512f avx512dq avx512bw avx512vl avx512_vnni\n"
NO_VNNI = "flags\t\t: fpu sse2 avx avx2 fma f16c bmi2 avx512f avx512dq avx512bw avx512vl\n"
AVX_ONLY = "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx\n"


def _cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: some CPU\n{flags}")
    return path


def test_each_cpu_takes_the_build_it_can_run(tmp_path: Path) -> None:
    assert kernel_isa(_cpuinfo(tmp_path, VNNI)) == "avx512"
    assert kernel_isa(_cpuinfo(tmp_path, NO_VNNI)) == "avx2"  # AVX-512 without VNNI: the AVX2 build
    assert kernel_isa(_cpuinfo(tmp_path, AVX2_ONLY)) == "avx2"
    assert kernel_isa(_cpuinfo(tmp_path, AVX_ONLY)) is None
    assert kernel_isa(_cpuinfo(tmp_path, "")) is None  # no flags line: not proven
