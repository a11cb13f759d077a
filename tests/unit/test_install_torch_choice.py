"""install.sh's torch choice: the CUDA build nvidia-smi's driver supports, else the CPU build."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

INSTALL = Path(__file__).resolve().parents[2] / "install.sh"
WHEELS = "https://download.pytorch.org/whl"
HEADER = """Mon Jun  9 12:00:00 2025
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI {driver}              Driver Version: {driver}      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
|=========================================+========================+======================|
|   0  NVIDIA H200                    On  |   00000000:18:00.0 Off |                    0 |
+-----------------------------------------+------------------------+----------------------+
"""
FAILED = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."


def _bin(tmp_path: Path) -> Path:
    """A PATH folder with bash and the few tools install.sh uses, and no nvidia-smi."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in ("bash", "dirname", "timeout", "cat", "python3"):
        found = shutil.which(tool)
        assert found, f"{tool} must be on PATH to run install.sh"
        (folder / tool).symlink_to(found)
    return folder


def _stand_in(folder: Path, text: str, code: int = 0) -> None:
    script = folder / "nvidia-smi"
    script.write_text(f"#!{folder / 'bash'}\ncat <<'EOF'\n{text}\nEOF\nexit {code}\n")
    script.chmod(0o755)


def _run(
    tmp_path: Path, folder: Path, args: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """Runs a copy of install.sh in tmp_path with only `folder` on PATH."""
    script = tmp_path / "install.sh"
    shutil.copy(INSTALL, script)
    return subprocess.run(
        [str(folder / "bash"), str(script), *args],
        check=False,
        cwd=tmp_path,
        env={"PATH": str(folder), "HOME": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _dry_run(tmp_path: Path, folder: Path, **env: str) -> str:
    """install.sh's dry run (the flag, or the variable when given); asserts it made no .venv."""
    done = _run(
        tmp_path, folder, [] if "SEAMLINE_INSTALL_DRY_RUN" in env else ["--torch-choice"], env
    )
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / ".venv").exists(), "the dry run must not create .venv"
    return done.stdout


@pytest.mark.parametrize(
    ("cuda", "build"),
    [("13.0", "cu130"), ("13.1", "cu130"), ("12.9", "cu128"), ("12.8", "cu128"), ("12.6", "cu126")],
)
def test_a_driver_takes_the_newest_cuda_build_it_supports(
    tmp_path: Path, cuda: str, build: str
) -> None:
    folder = _bin(tmp_path)
    _stand_in(folder, HEADER.format(driver="580.95.05", cuda=cuda))
    out = _dry_run(tmp_path, folder)
    version = f"{build[2:-1]}.{build[-1]}"
    assert (
        f"NVIDIA driver 580.95.05 (CUDA {cuda}) found: installing the CUDA {version} build" in out
    )
    assert f"torch==2.13.0 --index-url {WHEELS}/{build}\n" in out


def _assert_cpu(out: str, why: str) -> None:
    assert f"install.sh: {why}: installing the CPU build of torch" in out
    assert "--index-url" not in out
    assert out.rstrip().endswith("pip install --quiet --disable-pip-version-check torch==2.13.0")


def test_a_driver_older_than_cuda_12_6_takes_the_cpu_build(tmp_path: Path) -> None:
    folder = _bin(tmp_path)
    _stand_in(folder, HEADER.format(driver="550.54.14", cuda="12.4"))
    _assert_cpu(
        _dry_run(tmp_path, folder),
        "NVIDIA driver 550.54.14 (CUDA 12.4) found, too old "
        "for torch's CUDA builds (they need CUDA 12.6 or newer)",
    )


def test_a_failing_nvidia_smi_takes_the_cpu_build(tmp_path: Path) -> None:
    folder = _bin(tmp_path)
    _stand_in(folder, FAILED, code=9)
    _assert_cpu(_dry_run(tmp_path, folder), "no NVIDIA driver (nvidia-smi failed with exit 9)")


def test_no_nvidia_smi_takes_the_cpu_build(tmp_path: Path) -> None:
    out = _dry_run(tmp_path, _bin(tmp_path), SEAMLINE_INSTALL_DRY_RUN="1")
    _assert_cpu(out, "no NVIDIA driver (nvidia-smi not found)")


def test_the_override_wins(tmp_path: Path) -> None:
    folder = _bin(tmp_path)
    _stand_in(folder, HEADER.format(driver="580.95.05", cuda="13.0"))
    _assert_cpu(_dry_run(tmp_path, folder, SEAMLINE_TORCH="cpu"), "SEAMLINE_TORCH=cpu")
    out = _dry_run(tmp_path, folder, SEAMLINE_TORCH="cu126")
    assert "SEAMLINE_TORCH=cu126: installing the CUDA 12.6 build of torch" in out
    assert f"--index-url {WHEELS}/cu126\n" in out


def test_an_unknown_override_is_refused(tmp_path: Path) -> None:
    done = _run(tmp_path, _bin(tmp_path), ["--torch-choice"], {"SEAMLINE_TORCH": "cu118"})
    assert done.returncode == 2 and not (tmp_path / ".venv").exists()
    assert "SEAMLINE_TORCH must be cpu or one of cu130 cu128 cu126, not 'cu118'" in done.stderr
