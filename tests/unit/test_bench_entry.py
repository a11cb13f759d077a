"""`seamline bench` reaches the benchmarks' own package through its entry point, and says how to
install it where it is missing."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from seamline import cli
from seamline.errors import SeamlineError


def test_the_installed_benchmarks_are_found_through_their_entry_point() -> None:
    import seamline_bench

    assert cli._bench_entry("run") is seamline_bench.run_bench
    assert (
        cli._bench_entry("names") is seamline_bench.BENCHES
        and "conformance" in seamline_bench.BENCHES
    )
    out = subprocess.run(
        [sys.executable, "-m", "seamline.cli", "bench", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "conformance" in out and "throughput" in out


def test_a_missing_benchmark_package_is_one_line_saying_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda **_: importlib.metadata.EntryPoints(())
    )
    args = cli.build_parser().parse_args(
        ["bench", "throughput"]
    )  # any name: no list to check it against
    with pytest.raises(SeamlineError, match=r"not installed: \./install\.sh --bench") as caught:
        args.handler(args)
    assert "\n" not in str(caught.value)


def test_an_unknown_benchmark_names_those_there_are() -> None:
    import seamline_bench

    with pytest.raises(ValueError, match="unknown benchmark 'nope'; the benchmarks: single, split"):
        seamline_bench.run_bench("nope", None)
