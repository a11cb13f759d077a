"""The C++ kernels (quantized matmuls, decode attention): compiled once per source and torch version, cached, loaded on first use.

``kernels()`` answers ``torch.ops.seamline_quant`` or None when they cannot be had (no compiler,
not x86-64, a CPU without AVX2, or ``SEAMLINE_QUANT_KERNELS=0``); callers then take the torch
path, which is slower but gives the same answers up to activation rounding.

The sources are AVX-512 code. A CPU with AVX-512 VNNI gets them as written; one with only AVX2
(most AMD desktops and EPYCs before Zen 4, Intel's client cores) gets the same sources built
with ``SEAMLINE_AVX2``, their AVX-512 intrinsics emulated on 256-bit registers
(``kernels/avx2_512.h``): the same answers, at a fraction of the speed of native AVX-512 but
many times the torch path's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from seamline.cpu_flags import CPUINFO, ENV_SWITCH, cpu_flags, isa_of

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent / "kernels"
SOURCES = ("ops.cpp", "kernels.cpp", "dequant_bf16.cpp", "float_gemv.cpp", "decode.cpp", "amx.cpp")
HEADERS = (
    "kernels.h",
    "blocks.h",
    "store16.h",
    "intrinsics.h",
    "avx2_512.h",
)  # sources and headers: the cache key
AVX2_FLAG = "-DSEAMLINE_AVX2=1"  # the build for CPUs without AVX-512
CFLAGS = ("-O3", "-std=c++17", "-fno-math-errno", "-fopenmp")  # OpenMP: at::parallel_for is inline
LDFLAGS = ("-fopenmp",)  # libgomp.so.1: the one torch already loaded, so set_num_threads holds


def _cflags(isa: str) -> list[str]:
    return [*CFLAGS, AVX2_FLAG] if isa == "avx2" else list(CFLAGS)


def _digest(isa: str) -> str:
    h = hashlib.sha256(
        f"{torch.__version__} {sys.version_info[:2]} {_cflags(isa)} {LDFLAGS}".encode()
    )
    for name in (*SOURCES, *HEADERS):
        h.update((KERNEL_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "seamline" / "kernels"


def _compiler() -> str | None:
    return (
        shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    )


def _ninja() -> str | None:
    """torch's extension builder runs ninja; the interpreter's bin dir counts even off PATH."""
    path = os.pathsep.join([os.environ.get("PATH", ""), os.path.dirname(sys.executable)])
    return shutil.which("ninja", path=path)


def _build(name: str, build_dir: Path, isa: str) -> None:
    """Compile with torch's extension builder; the interpreter's own bin dir joins PATH for ninja."""
    from torch.utils.cpp_extension import load

    old_path = os.environ.get("PATH", "")
    bin_dir = os.path.dirname(sys.executable)
    os.environ["PATH"] = os.pathsep.join([old_path, bin_dir]) if old_path else bin_dir
    try:
        log.warning("compiling the quant kernels once (about 15 s) into %s", build_dir)
        load(
            name=name,
            sources=[str(KERNEL_DIR / s) for s in SOURCES],
            extra_cflags=_cflags(isa),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    finally:
        os.environ["PATH"] = old_path


def _load(isa: str) -> Any:
    """Load the cached library for ``isa``, else build it; a failed build is remembered (FAILED)
    so that later processes do not retry the same sources with the same compiler."""
    name = f"seamline_quant_{isa}_{_digest(isa)}"
    build_dir = cache_dir() / name
    library, failed = build_dir / f"{name}.so", build_dir / "FAILED"
    if (
        library.exists() and not (build_dir / "lock").exists()
    ):  # "lock": another process still building
        torch.ops.load_library(str(library))
    elif failed.exists():
        raise RuntimeError(f"an earlier build failed; remove {build_dir} to retry")
    else:
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            _build(name, build_dir, isa)
        except Exception as exc:
            failed.write_text(str(exc))
            raise
    return torch.ops.seamline_quant


_BUILD_LOCK = threading.Lock()


@lru_cache(maxsize=1)
def kernels() -> Any | None:
    """torch.ops.seamline_quant, or None (logged once) when the kernels are unavailable here."""
    with _BUILD_LOCK:  # one build per process; the builder's lock file serialises processes
        return _kernels_once()


def _kernels_once() -> Any | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        log.warning("quant kernels need x86-64; quantized matmuls use the slower torch path")
        return None
    if _compiler() is None or _ninja() is None:
        missing = "a C++ compiler" if _compiler() is None else "ninja (pip install ninja)"
        log.warning("no %s found; quantized matmuls use the slower torch path", missing)
        return None
    isa = (
        kernel_isa()
    )  # checked before loading: code for an instruction set the CPU lacks kills the process
    if isa is None:
        log.info("CPU lacks AVX2; quantized matmuls use the slower torch path")  # nothing to act on
        return None
    try:
        ops = _load(isa)
    except Exception as exc:  # a failed build must not stop seamline
        log.warning(
            "quant kernels failed to build (%s); using the slower torch path",
            str(exc).splitlines()[0],
        )
        return None
    if not ops.cpu_supported():
        log.warning("CPU lacks %s; quantized matmuls use the slower torch path", isa.upper())
        return None
    _register_shapes()
    return ops


def kernel_isa(cpuinfo: Path = CPUINFO) -> str | None:
    """The kernels' build this CPU runs: "avx512", "avx2" or None, from its flags (Linux), else
    from torch's own capability reading."""
    if cpuinfo.is_file():  # a flags line that lacks them, or no flags line at all: not proven
        return isa_of(cpu_flags(cpuinfo))
    capability = torch.backends.cpu.get_cpu_capability()
    return "avx512" if capability.startswith("AVX512") else "avx2" if capability == "AVX2" else None


def _register_shapes() -> None:
    """Shape-only versions of the ops, so that tracers (torch.compile, meta tensors) see through them."""

    @torch.library.register_fake("seamline_quant::linear")
    def _linear(
        x: torch.Tensor,
        w: torch.Tensor,
        qtype: int,
        cols: int,
        bias: torch.Tensor | None,
        decode_rows: int,
        amx_from: int = 0,
    ) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake("seamline_quant::dequant_bf16")
    def _dequant(w: torch.Tensor, qtype: int, cols: int, native: bool = True) -> torch.Tensor:
        return w.new_empty((w.shape[0], cols), dtype=torch.bfloat16)

    @torch.library.register_fake("seamline_quant::decode_attention")
    def _attention(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pos: int,
        heads: int,
        kv_heads: int,
        window: int = 0,
    ) -> torch.Tensor:
        return qkv.new_empty((1, heads * k_cache.shape[-1]))

    @torch.library.register_fake("seamline_quant::decode_attention_batch")
    def _attention_batch(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        positions: list[int],
        heads: int,
        kv_heads: int,
        window: int = 0,
    ) -> torch.Tensor:
        return qkv.new_empty((qkv.shape[0], heads * k_caches[0].shape[-1]))

    @torch.library.register_fake("seamline_quant::rms_norm")
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake("seamline_quant::add_rms_norm")
    def _add_rms_norm(
        x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("seamline_quant::silu_mul")
    def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))

    @torch.library.register_fake("seamline_quant::dequant_f32")
    def _dequant_f32(w: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
        return w.new_empty((w.shape[0], cols), dtype=torch.float32)
