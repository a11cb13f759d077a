"""The C++ kernels are AVX-512 code throughout: a CPU without AVX-512 VNNI (an AVX2-only AMD
EPYC, say) must never load them (it dies of an illegal instruction), and takes the torch path."""

from __future__ import annotations

from pathlib import Path

from seamline.quant.native import cpu_has_avx512_vnni

AVX2_ONLY = "flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2\n"
VNNI = "flags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni\n"
NO_VNNI = "flags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512bw avx512vl\n"


def _cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: some CPU\n{flags}")
    return path


def test_only_a_cpu_with_avx512_vnni_takes_the_kernels(tmp_path: Path) -> None:
    assert cpu_has_avx512_vnni(_cpuinfo(tmp_path, VNNI))
    assert not cpu_has_avx512_vnni(_cpuinfo(tmp_path, AVX2_ONLY))
    assert not cpu_has_avx512_vnni(_cpuinfo(tmp_path, NO_VNNI))
    assert not cpu_has_avx512_vnni(_cpuinfo(tmp_path, ""))  # no flags line: not proven
