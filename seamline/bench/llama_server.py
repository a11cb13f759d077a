"""llama.cpp's `llama-server`, the one-machine alternative a throughput benchmark compares with.

Found as ``SEAMLINE_LLAMA_SERVER`` or on PATH, else built once (a few minutes, two cores) with
cmake from the llama.cpp sources vendored in the source package of the installed
``llama-cpp-python`` (fetched from PyPI), statically linked and cached under
``$SEAMLINE_CACHE/llama-server/``. The build targets this CPU (``GGML_NATIVE``); its AMX path
crashes on this machine's VM, so the server runs with ``--no-repack`` (see shared/COMPUTE.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
)  # fmt: skip


def cache_root() -> Path:
    return Path(os.environ.get("SEAMLINE_CACHE", Path.home() / ".cache" / "seamline")) / "llama-server"


def llama_server_binary() -> tuple[Path | None, str]:
    """(the binary, "") or (None, why there is none)."""
    given = os.environ.get("SEAMLINE_LLAMA_SERVER") or shutil.which("llama-server")
    if given:
        return Path(given), ""
    try:
        version = metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return None, "llama-cpp-python is not installed (its source package vendors llama.cpp)"
    built = cache_root() / version / "llama-server"
    if built.is_file():
        return built, ""
    try:
        _build(version, built)
    except (OSError, subprocess.CalledProcessError) as exc:
        return None, f"building llama-server {version} failed: {exc}"
    return built, ""


def _build(version: str, target: Path) -> None:
    if shutil.which("cmake") is None:
        raise OSError("cmake is not installed")
    with tempfile.TemporaryDirectory(prefix="seamline-llama-") as tmp:
        work = Path(tmp)
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, f"llama-cpp-python=={version}", "-d", str(work)], check=True)
        archive = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = work / "build"
        print(f"building llama-server {version} from {archive.name} (a few minutes)", file=sys.stderr, flush=True)
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], check=True, capture_output=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True,
                       capture_output=True)  # fmt: skip
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", target.with_suffix(".partial"))
        target.with_suffix(".partial").rename(target)


def server_command(binary: Path, gguf: Path, port: int, threads: int, slots: int, context_per_slot: int) -> list[str]:
    """``llama-server --parallel slots`` with continuous batching, each slot ``context_per_slot`` long."""
    return [
        str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
        "-tb", str(threads), "--parallel", str(slots), "-c", str(slots * context_per_slot), "--cont-batching",
        "--no-repack", "--no-webui", "-a", "llama-server",
    ]  # fmt: skip
