"""Benchmarks behind `seamline bench NAME --json PATH`: each writes one JSON object."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def run_bench(name: str, json_path: str | None, **options: Any) -> dict[str, Any]:
    if name == "single":
        from seamline.bench.single import bench_single

        result = bench_single(**options)
    elif name == "split":
        from seamline.bench.split import bench_split

        result = bench_split(**options)
    elif name == "lockstep":
        from seamline.bench.lockstep import bench_lockstep

        result = bench_lockstep(**options)
    elif name == "quant":
        from seamline.bench.quant import bench_quant

        result = bench_quant(repeats=options["repeats"], tokens=options["tokens"])
    elif name == "fuzz":
        from seamline.bench.fuzz import bench_fuzz

        result = bench_fuzz(**({"inputs_per_surface": options["inputs"]} if options.get("inputs") else {}),
                            only=options.get("only"))  # fmt: skip
    elif name == "chaos":
        from seamline.bench.chaos import bench_chaos

        result = bench_chaos(**({"rounds": options["rounds"]} if options.get("rounds") else {}))
    elif name == "growth":
        from seamline.bench.growth import bench_growth

        result = bench_growth()
    elif name == "spec":
        from seamline.bench.spec import bench_spec

        result = bench_spec(repeats=options["repeats"])
    elif name == "gpu":
        from seamline.bench.gpu import bench_gpu

        result = bench_gpu(tokens=options["tokens"])
    elif name == "throughput":
        from seamline.bench.throughput import bench_throughput

        result = bench_throughput(repeats=options["repeats"], tokens=options["tokens"])
    elif name == "scale":
        from seamline.bench.scale import bench_scale

        result = bench_scale(repeats=options["repeats"], tokens=options["tokens"])
    elif name == "families":
        from seamline.bench.families import bench_families

        result = bench_families(repeats=options["repeats"])
    elif name == "conformance":
        from seamline.bench.conformance import bench_conformance

        result = bench_conformance()  # 32 tokens a prompt, as the comparison is defined
    else:
        raise ValueError(f"unknown benchmark {name!r}")
    text = json.dumps(result, indent=2)
    if json_path:
        Path(json_path).write_text(text + "\n")
    print(text, file=sys.stdout)
    return result
