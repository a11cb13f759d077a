"""Resident memory of a loaded range, measured in a fresh process.

``python -m seamline_bench.resident MODEL START END [DTYPE]`` loads layers [START, END) of
MODEL (a GGUF file or a fragment package; the embedding and head come with the first and
last layer), runs one token, and prints JSON: the process's RSS growth from just before the
load to just after that token (torch, seamline and the kernels are imported and warmed
first), the KV cache bytes of that token, the growth less the cache
(``resident_weight_bytes``), and the bytes the range's tensors take in the GGUF file
(``gguf_tensor_bytes``, from the file or the package's manifest).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import torch

from seamline.ownership import Ownership
from seamline.weights.loader import DTYPES, load_stage, open_source


def measure_in_subprocess(
    model: str | Path, start: int, end: int, dtype: str = "float32"
) -> dict[str, Any]:
    """Run this module in a fresh interpreter (a clean RSS) and return its JSON."""
    command = [
        sys.executable,
        "-m",
        "seamline_bench.resident",
        str(model),
        str(start),
        str(end),
        dtype,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"resident measurement failed: {done.stderr.strip()[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _warm_up() -> None:
    """Import and run what any load needs (kernels, thread pool) before the baseline."""
    from seamline.quant.native import kernels

    kernels()
    torch.ones(64, 64) @ torch.ones(64, 64)


def _stored_bytes(model: Path, names: set[str]) -> int:
    """The bytes ``names`` take in the checkpoint as stored: GGUF tensor bytes."""
    source = open_source(model)
    if hasattr(source, "manifest"):  # a package: its tensor entries hold the GGUF types
        from seamline.quant.sizes import resident_bytes

        entries = {t.name: t for f in source.manifest.fragments for t in f.tensors}
        return sum(resident_bytes(entries[n].shape, entries[n].dtype, 4) for n in names)
    return sum(source.stored_bytes(n) for n in names)


def measure(model: Path, start: int, end: int, dtype: str) -> dict[str, Any]:
    _warm_up()
    process = psutil.Process()
    before = process.memory_info().rss
    stage = load_stage(open_source(model), Ownership(layers=(start, end)), DTYPES[dtype])
    cache = stage.new_cache()
    inputs = (
        torch.tensor([1])
        if stage.embed is not None
        else torch.zeros(1, stage.config.hidden_size, dtype=stage.compute_dtype)
    )
    stage(inputs, 0, cache)
    grown = process.memory_info().rss - before
    kv = sum(
        t.numel() * t.element_size()
        for kv in cache.layers.values()
        for t in (kv.k, kv.v)
        if t is not None
    )
    from seamline.weights.names import stage_plans

    names = {n for p in stage_plans(stage.config, stage.ownership) for n in p.sources()}
    return {
        "rss_growth_bytes": grown,
        "kv_cache_bytes": kv,
        "resident_weight_bytes": grown - kv,
        "gguf_tensor_bytes": _stored_bytes(model, names),
        "layers": [start, end],
    }


if __name__ == "__main__":
    path, first, last = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(measure(path, first, last, sys.argv[4] if len(sys.argv) > 4 else "float32")))
