"""llama.cpp at its best on this machine: `llama-server` and `llama-bench`, the peers that
`bench throughput` and `bench quant` compare with, and `llama-quantize`, which writes
`bench conformance`'s Q4_K_M files.

Built once (several minutes on two cores) with cmake from the llama.cpp sources vendored in the
source package of llama-cpp-python ``LLAMA_CPP_PYTHON`` (fetched with pip), statically linked,
into ``$SEAMLINE_CACHE/llama-cpp/<version>-<hash of the flags>/``, so that a build with other
flags (an older native one) is never reused. The flags (``CPU_FLAGS``, shared/COMPUTE.md):
AVX-512 with VBMI, VNNI and BF16, without AMX and without ``GGML_NATIVE``, whose AMX path
crashes on this VM; so the binaries run with llama.cpp's defaults, weight repacking included
(``--no-repack`` would avoid that crash only by giving up the repacked kernels).
``SEAMLINE_LLAMA_CPP_BIN``: a folder holding both binaries to run instead (its flags unknown).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from seamline.cpu_flags import cpu_flags, isa_of

LLAMA_CPP_PYTHON = "0.3.36"  # the source package whose vendored llama.cpp is built
BIN_ENV = "SEAMLINE_LLAMA_CPP_BIN"
TARGETS = (
    "llama-server",
    "llama-bench",
    "llama-quantize",
)  # quantize: bench conformance's Q4_K_M files
BASE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
)
AVX2_FLAGS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
)
AVX512_FLAGS = (
    "-DGGML_AVX512=ON",
    "-DGGML_AVX512_VBMI=ON",
    "-DGGML_AVX512_VNNI=ON",
    "-DGGML_AVX512_BF16=ON",
)
# AVX-512 where the CPU has it (an AVX2-only CPU dies of an illegal instruction in such a build)
CPU_FLAGS = AVX2_FLAGS + (AVX512_FLAGS if isa_of(cpu_flags()) == "avx512" else ())
CMAKE_FLAGS = BASE_FLAGS + CPU_FLAGS


@dataclass(frozen=True)
class LlamaBuild:
    """Where the two binaries are and how they were made."""

    folder: Path
    source: str  # what was built, or who gave the binaries
    cmake_flags: tuple[str, ...] | None  # None: not built here

    @property
    def server(self) -> Path:
        return self.folder / "llama-server"

    @property
    def bench(self) -> Path:
        return self.folder / "llama-bench"

    @property
    def quantize(self) -> Path:
        return self.folder / "llama-quantize"

    def describe(self) -> dict[str, Any]:
        """The build for a benchmark's JSON: version line, binaries, source and cmake flags."""
        return {
            "version": _version(self.server),
            "llama_server": str(self.server),
            "llama_bench": str(self.bench),
            "source": self.source,
            "cmake_flags": list(self.cmake_flags) if self.cmake_flags else None,
        }


def cache_root() -> Path:
    return Path(os.environ.get("SEAMLINE_CACHE", Path.home() / ".cache" / "seamline")) / "llama-cpp"


def build_key(version: str = LLAMA_CPP_PYTHON, flags: tuple[str, ...] = CMAKE_FLAGS) -> str:
    """The cache folder's name: the version and a hash of the flags and targets."""
    digest = hashlib.sha256(" ".join((*flags, *TARGETS)).encode()).hexdigest()[:12]
    return f"{version}-{digest}"


def llama_cpp_build(build: bool = True) -> tuple[LlamaBuild | None, str]:
    """(the build, "") or (None, why there is none); ``build=False``: only a cached one."""
    given = os.environ.get(BIN_ENV)
    if given:
        found = LlamaBuild(Path(given), f"given by {BIN_ENV}", None)
        missing = [p for p in (found.server, found.bench) if not p.is_file()]
        return (None, f"{BIN_ENV}={given} lacks {missing[0].name}") if missing else (found, "")
    folder = cache_root() / build_key()
    source = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz: vendor/llama.cpp"
    made = LlamaBuild(folder, source, CMAKE_FLAGS)
    if all((folder / target).is_file() for target in TARGETS):
        return made, ""
    if not build:
        return (
            None,
            f"llama.cpp is not built yet in {folder} (a benchmark builds it: several minutes)",
        )
    try:
        _build(folder)
    except (OSError, StopIteration, tarfile.TarError) as exc:
        return None, f"building llama.cpp from llama-cpp-python {LLAMA_CPP_PYTHON} failed: {exc}"
    return made, ""


def _run(command: list[str], what: str) -> None:
    """Run ``command`` quietly; OSError with the tail of its output if it fails."""
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise OSError(f"{what} exited with {out.returncode}: {(out.stdout + out.stderr)[-1500:]}")


def _build(folder: Path) -> None:
    if shutil.which("cmake") is None:
        raise OSError("cmake is not installed")
    with tempfile.TemporaryDirectory(prefix="seamline-llama-") as tmp:
        work = Path(tmp)
        pip = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
        ]
        _run([*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(work)], "pip download")
        archive = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = work / "build"
        print(
            f"building llama.cpp ({', '.join(TARGETS)}) from {archive.name}: several minutes",
            file=sys.stderr,
            flush=True,
        )
        _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], "cmake")
        jobs = str(os.cpu_count() or 2)
        _run(["cmake", "--build", str(build), "--target", *TARGETS, "-j", jobs], "cmake --build")
        partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
        partial.mkdir(parents=True, exist_ok=True)
        for target in TARGETS:
            shutil.copy2(build / "bin" / target, partial / target)
        try:
            partial.rename(folder)
        except OSError:  # another process finished the same build first
            shutil.rmtree(partial, ignore_errors=True)


def _version(binary: Path) -> str:
    """``llama-server --version``'s lines (its build number, commit and compiler), joined."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    return "; ".join(
        line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip()
    )


def server_command(
    binary: Path, gguf: Path, port: int, threads: int, slots: int, context_per_slot: int
) -> list[str]:
    """``llama-server --parallel slots`` with continuous batching, each slot ``context_per_slot``
    long; llama.cpp's defaults otherwise (weight repacking on)."""
    return [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--parallel",
        str(slots),
        "-c",
        str(slots * context_per_slot),
        "--cont-batching",
        "--no-webui",
        "-a",
        "llama-server",
    ]
