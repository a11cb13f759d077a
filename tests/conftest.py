"""Fixtures shared by the tests: the embedded model, loaded once per module, and the real
openai client against a real server on it (test_openai_api.py and test_mesh.py keep their own:
theirs differ); the quant kernels (``ops``), which must load on every machine of this project."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the Triton kernels run in Triton's interpreter on CPU tensors;
    os.environ.setdefault(
        "TRITON_INTERPRET", "1"
    )  # read when a kernel is defined: before any import of one

import platform
import shutil
from collections.abc import Iterator

import openai
import pytest

from seamline.app import LocalModel
from seamline.quant import native
from seamline.runtime.backend import LocalBackend
from tests.support.api import NAME, client_for, serve


@pytest.fixture(scope="module", autouse=True)
def _module_files_go(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """A module's checkpoints and meshes' folders (its module-scoped fixtures') go once it passed
    (``tmp_path_retention_policy`` removes a passed test's own): the suite writes GBs of them."""
    base = tmp_path_factory.getbasetemp()
    before, failed = set(base.iterdir()), request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        for path in set(base.iterdir()) - before:
            if path.is_symlink():  # pytest's "<name>current" links
                path.unlink()
            else:
                shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def model() -> LocalModel:
    return LocalModel.load()


@pytest.fixture(scope="module")
def client(model: LocalModel) -> Iterator[openai.OpenAI]:
    with serve(LocalBackend(model.engine, model.codec, NAME)) as url:
        yield client_for(url)


def _kernels_expected() -> bool:
    """The kernels must load wherever they can: x86-64, a compiler, AVX2 at least."""
    if platform.machine().lower() not in ("x86_64", "amd64") or shutil.which("c++") is None:
        return False
    return native.kernel_isa() is not None


@pytest.fixture(scope="module")
def ops():
    """The C++ ops, which must load on every x86-64 CPU with AVX2 and a compiler (AVX-512 VNNI:
    as written; AVX2 only: the emulated build); elsewhere their tests are skipped, naming the CPU.
    The torch path that such CPUs take is tested everywhere (``use_kernels=False``)."""
    if not _kernels_expected():
        pytest.skip(
            "the C++ quant kernels need x86-64, a C++ compiler and AVX2; this CPU "
            f"reports {torch.backends.cpu.get_cpu_capability()}"
        )
    ops = native.kernels()
    assert ops is not None, "the quant kernels failed to load on a CPU that supports them"
    return ops


@pytest.fixture
def torch_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantised weights multiply as dequantise + F.linear (no int8 / bf16 kernel rounding).
    The kernel ops are resolved once per process into ``_OP`` / ``_EXACT``: fresh lists here,
    so a test's "no kernels" is not what later tests in the process find."""
    from seamline.quant import matmul

    monkeypatch.setattr(matmul, "kernels", lambda: None)
    monkeypatch.setattr(matmul, "_OP", [])
    monkeypatch.setattr(matmul, "_EXACT", [])
