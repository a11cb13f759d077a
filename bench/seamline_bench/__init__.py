"""seamline's benchmarks, a package of their own: `seamline bench NAME --json PATH` finds
``run_bench`` through the ``seamline.bench`` entry point. Each benchmark writes one JSON object."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

# name -> (module, function, the options of `seamline bench` it takes)
BENCHES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "single": ("single", "bench_single", ("repeats", "tokens")),
    "split": ("split", "bench_split", ("repeats", "tokens")),
    "lockstep": ("lockstep", "bench_lockstep", ("repeats", "tokens")),
    "quant": ("quant", "bench_quant", ("repeats", "tokens")),
    "throughput": ("throughput", "bench_throughput", ("repeats", "tokens")),
    "fuzz": ("fuzz", "bench_fuzz", ("inputs_per_surface", "only", "attacks")),
    "chaos": ("chaos", "bench_chaos", ("rounds",)),
    "growth": ("growth", "bench_growth", ()),
    "spec": ("spec", "bench_spec", ("repeats",)),
    "gpu": ("gpu", "bench_gpu", ("tokens",)),
    "families": ("families", "bench_families", ("repeats",)),
    "scale": ("scale", "bench_scale", ("repeats", "tokens")),
    "conformance": ("conformance", "bench_conformance", ()),  # 32 tokens a prompt, by definition
}


def run_bench(name: str, json_path: str | None, **options: Any) -> dict[str, Any]:
    """Run benchmark ``name`` with those of ``options`` it takes (a value of None or 0 leaves
    its default); print its JSON and write it to ``json_path`` where given."""
    if name not in BENCHES:
        raise ValueError(f"unknown benchmark {name!r}; the benchmarks: {', '.join(BENCHES)}")
    module, function, takes = BENCHES[name]
    bench = getattr(importlib.import_module(f"seamline_bench.{module}"), function)
    result = bench(**{k: options[k] for k in takes if options.get(k)})
    text = json.dumps(result, indent=2)
    if json_path:
        Path(json_path).write_text(text + "\n")
    print(text, file=sys.stdout)
    return dict(result)
