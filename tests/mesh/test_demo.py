"""The README's first command: `seamline demo --nodes 2`, a coordinator and two node processes
on this machine answering the default question at the default (fast) precision."""

from __future__ import annotations

from tests.support.cli import seamline


def test_demo_splits_the_embedded_model_and_answers() -> None:
    proc = seamline("demo", "--nodes", "2", "--max-tokens", "16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer = next(line for line in proc.stdout.splitlines() if line.startswith("answer:"))
    assert "Tokyo" in answer, proc.stdout
    assert "tokens/s" in proc.stdout
