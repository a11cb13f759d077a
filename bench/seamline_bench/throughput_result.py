"""`bench throughput`'s JSON from its waves: per model, party and client count the median rate
and pooled latency percentiles, the ratios the issue asks for, and the targets they meet.

* ``models.<m>.vs_llamacpp_<n>``: seamline (``serve --single``, the default) ÷ llama-server at
  ``n`` clients (``--parallel 16`` up to 16 clients, ``--parallel 64`` above);
* ``models.<m>.batch_gain_16``: seamline at 16 clients ÷ 1 client;
* ``exact_batch_gain_16``: ``--precision exact`` on the 1.1B, 16 clients ÷ 1;
* ``mesh_single_ratio``: the 2-stage mesh at 1 client ÷ ``serve --single`` at 1 client;
* ``single_stream_ratio``: the median over rounds of one stream's decode rate through the
  API (embedded, 1 client) ÷ the engine's own decode rate on the same prompt in that round;
* ``machine``: per round, the seconds waited for a quiet machine and the CPU share (of all
  cores) that processes outside the bench took; ``quiet``: every round under ``QUIET_SHARE``.
"""

from __future__ import annotations

import statistics
from typing import Any

from seamline_bench.machine_load import QUIET_SHARE
from seamline_bench.quant import targets_met

# model -> party -> client count -> that round's waves (``load.run_wave``'s dicts)
Runs = dict[str, dict[str, dict[int, list[dict[str, Any]]]]]
TARGETS = {
    "embedded.vs_llamacpp_1": 0.8,
    "llama_1b.vs_llamacpp_1": 0.95,
    "embedded.vs_llamacpp_16": 2.0,
    "llama_1b.vs_llamacpp_16": 1.3,
    "single_stream_ratio": 0.9,
    "exact_batch_gain_16": 3.0,
    "mesh_single_ratio": 0.85,
}
SEAMLINE = (
    "seamline `serve --single --model X`: no flag, no SEAMLINE_* variable (the default precision)"
)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def cell(waves: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One party at one client count: median rate, pooled latency percentiles."""
    if not waves:
        return None
    ttft = [t for w in waves for t in w["ttft_ms"]]
    itl = [t for w in waves for t in w["itl_ms"]]
    return {
        "tok_s": round(statistics.median(w["tok_s"] for w in waves), 2),
        "ttft_p50_ms": _pct(ttft, 0.5),
        "ttft_p95_ms": _pct(ttft, 0.95),
        "itl_p50_ms": _pct(itl, 0.5),
        "itl_p95_ms": _pct(itl, 0.95),
        "runs_tok_s": [round(w["tok_s"], 2) for w in waves],
    }


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    return round(a["tok_s"] / b["tok_s"], 3) if a and b else None


def _model(parties: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, Any]:
    """One model's table and ratios."""
    table = {
        name: {str(n): cell(waves) for n, waves in sorted(by_n.items())}
        for name, by_n in parties.items()
    }
    ours = table.get("seamline", {})
    out: dict[str, Any] = {"configs": table, "batch_gain_16": _ratio(ours.get("16"), ours.get("1"))}
    for n in sorted(int(k) for k in ours):
        theirs = table.get("llamacpp_16" if n <= 16 else "llamacpp_64", {}).get(str(n))
        out[f"vs_llamacpp_{n}"] = _ratio(ours.get(str(n)), theirs)
    return out


def single_stream(runs: Runs, engine: list[float]) -> dict[str, Any]:
    """The embedded model's one stream through the API against the engine, round by round."""
    waves = runs.get("embedded", {}).get("seamline", {}).get(1, [])
    api = [w["decode_tok_s"][0] if w.get("decode_tok_s") else None for w in waves]
    pairs = [(a, e) for a, e in zip(api, engine) if a and e]
    return {
        "single_stream_ratio": round(statistics.median(a / e for a, e in pairs), 3)
        if pairs
        else None,
        "api_decode_tok_s": round(statistics.median(a for a, _ in pairs), 2) if pairs else None,
        "engine_decode_tok_s": round(statistics.median(engine), 2) if engine else None,
        "single_stream_runs": [{"api": round(a, 2), "engine": round(e, 2)} for a, e in pairs],
    }


def result(
    runs: Runs,
    engine: list[float],
    missing: dict[str, str],
    tokens: int,
    repeats: int,
    prompt_tokens: list[int],
    llama_cpp: dict[str, Any],
    logs: str,
    machine: list[dict[str, float]] | None = None,
) -> dict[str, Any]:
    models = {name: _model(parties) for name, parties in runs.items()}
    big = models.get("llama_1b", {}).get("configs", {}).get("seamline_exact", {})
    small = models.get("embedded", {}).get("configs", {})
    figures: dict[str, Any] = {
        "exact_batch_gain_16": _ratio(big.get("16"), big.get("1")),
        "mesh_single_ratio": _ratio(
            small.get("mesh_2_stages", {}).get("1"), small.get("seamline", {}).get("1")
        ),
        **single_stream(runs, engine),
    }
    flat = {
        **figures,
        **{f"{m}.{k}": v for m, o in models.items() for k, v in o.items() if k != "configs"},
    }
    return {
        "bench": "throughput",
        "models": models,
        **figures,
        "targets": TARGETS,
        "targets_met": targets_met(flat, TARGETS),
        "seamline": SEAMLINE,
        "llama_cpp": llama_cpp,
        "threads": 2,
        "generated_tokens_per_client": tokens,
        "prompt_tokens": prompt_tokens,
        "repeats": repeats,
        "machine": {
            "rounds": machine or [],
            "quiet_share": QUIET_SHARE,
            "quiet": all(r["foreign_cpu_share"] < QUIET_SHARE for r in machine or []),
        },
        "not_measured": missing,
        "logs": logs,
    }
