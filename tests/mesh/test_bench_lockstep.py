"""`seamline bench lockstep` end to end on a tiny DeepSeek-V3-style checkpoint (tcp only).

The rates of a tiny model say nothing; what must hold at any size: the JSON has its fields,
the group's greedy tokens equal the single engine's, and the bytes a rank measurably sends per
token are within 10% of the wire formula.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from seamline_bench.lockstep import bench_lockstep

FIELDS = (
    "single_tok_s",
    "lockstep2_tok_s",
    "speedup",
    "tokens_match",
    "bytes_per_token_measured",
    "bytes_per_token_theory",
    "bytes_ratio",
    "bytes_method",
)


def test_bench_lockstep_tiny_tcp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plaintext tcp and tcp over mutual TLS, side by side: both give the single engine's tokens;
    TLS's records add a little to the bytes on the wire."""
    monkeypatch.setenv("SEAMLINE_CACHE", str(tmp_path / "cache"))
    result = bench_lockstep(repeats=1, tokens=8, size="tiny", transports=("tcp", "tcp_tls"))
    for key in FIELDS:
        assert key in result, key
    tcp = result["transports"]["tcp"]
    for key in FIELDS:
        assert key in tcp, key
    assert result["tokens_match"] is True and tcp["tokens_match"] is True
    assert 0.9 <= tcp["bytes_ratio"] <= 1.1, tcp
    tls = result["transports"]["tcp_tls"]
    assert tls["tokens_match"] is True and result["speedup_tls"] == tls["speedup"] > 0
    assert (
        tcp["bytes_per_token_measured"]
        < tls["bytes_per_token_measured"]
        < 1.5 * tcp["bytes_per_token_measured"]
    )
    assert tcp["single_tok_s"] > 0 and tcp["lockstep2_tok_s"] > 0
    assert len(result["single_runs_tok_s"]) == 1 and len(tcp["runs_tok_s"]) == 1
    model = result["model"]
    assert (
        model["routed_experts"] % 2 == 0 and model["layers"] == 2 and model["checkpoint_bytes"] > 0
    )
    # the two cores side by side: what a perfect split could reach on them, and the share of it reached
    assert (
        len(result["both_cores_single_tok_s"]) == 2 and min(result["both_cores_single_tok_s"]) > 0
    )
    ideal = 2 * min(result["both_cores_single_tok_s"]) / result["single_tok_s"]
    assert result["ideal_speedup_given_cores"] == pytest.approx(ideal, abs=2e-3)
    of_ideal = result["speedup"] / result["ideal_speedup_given_cores"]
    assert result["speedup_of_ideal"] == pytest.approx(of_ideal, rel=1e-2)
    # the DeepSeek-V4 rows (a tiny V4 here): the group's greedy tokens equal the single engine's
    assert result["v4_tokens_match"] is True and result["v4_lockstep_speedup"] > 0
    assert result["v4_single_tok_s"] > 0 and len(result["v4_runs_tok_s"]["lockstep2"]) == 1
