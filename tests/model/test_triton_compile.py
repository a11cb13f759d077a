"""Every Triton kernel compiles for a Hopper GPU (sm_90) here, without one (Triton's compiler and
ptxas come with the triton wheel). The interpreter that runs the other kernel tests on the CPU
accepts kernels the compiler refuses (a global that is not a constexpr, say): this checks that
what passes there also builds for a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is a test dependency (pip install -e '.[test]')")


def test_every_triton_kernel_compiles_for_hopper() -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.triton_compile"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [line for line in done.stdout.splitlines() if line.startswith("compiled ")]
    assert len(compiled) == 2 * 8 + 5, done.stdout
