"""One model on a CUDA GPU in a fresh process: memory, prefill rate and kernel-launch share.

``python -m seamline_bench.gpu_probe PATH`` prints one JSON line:

* ``memory``: the CUDA context (memory in use once torch has initialised the device, before any
  weight), the weights' allocation (``torch.cuda.memory_allocated`` across ``place_stage``)
  against the GGUF file's tensor bytes (``weights_ratio``; target at most 1.25), and a 512-token
  sequence's KV cache apart.
* ``prefill_tok_s``: a 512-token prompt in one forward, after a warm-up.
* ``launch``: decode steps timed on the wall against the GPU's own busy time in them (the
  profiler's kernel durations): ``launch_share`` = 1 - busy / wall, the time the GPU waits on the
  host to launch the next kernel.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import gguf
import torch

PROMPT_ROWS = 512
DECODE_STEPS = 32


def tensor_bytes(path: str) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def _synced(fn: Any) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - began


def probe(path: str) -> dict[str, Any]:
    from seamline.model.devices import place_stage
    from seamline.precision import apply, resolve, weights_kind
    from seamline.weights.loader import DTYPES, load_stage, open_source

    device = torch.device("cuda")
    torch.cuda.init()
    torch.empty(1, device=device)
    free, total = torch.cuda.mem_get_info(device)
    context = total - free  # this process's context (and any other process on the GPU)
    source = open_source(path)
    chosen = resolve(
        "fast", weights_kind(source.stored_type(n) for n in source.names()), accelerator=True
    )
    apply(chosen)
    stage = load_stage(source, dtype=DTYPES[chosen.dtype])
    before = torch.cuda.memory_allocated(device)
    place_stage(stage, device)
    weights = torch.cuda.memory_allocated(device) - before
    ids = torch.arange(PROMPT_ROWS) % stage.config.vocab_size
    stage.forward(ids, 0, stage.new_cache())  # warm-up: kernels compiled
    cache = stage.new_cache()
    before = torch.cuda.memory_allocated(device)
    seconds = _synced(lambda: stage.forward(ids, 0, cache, last_only=True))
    kv = torch.cuda.memory_allocated(device) - before
    stored = tensor_bytes(path)
    return {
        "precision": chosen.describe(),
        "device": torch.cuda.get_device_name(device),
        "memory": {
            "cuda_context_bytes": context,
            "weights_allocated_bytes": weights,
            "gguf_tensor_bytes": stored,
            "weights_ratio": weights / stored,
            "kv_cache_bytes_512_tokens": kv,
        },
        "prefill_tok_s": PROMPT_ROWS / seconds,
        "launch": _launch_share(stage, cache),
    }


def _launch_share(stage: Any, cache: Any) -> dict[str, Any]:
    """One-row decode steps, eager and replayed as CUDA graphs (``runtime/cuda_graphs.py``)."""
    from seamline.model.cache import Span
    from seamline.runtime.cuda_graphs import GraphedDecode

    graphs = GraphedDecode.for_stage(stage, PROMPT_ROWS + 4 * DECODE_STEPS)
    position = [PROMPT_ROWS]

    def eager() -> None:
        stage.forward(torch.tensor([1]), position[0], cache, last_only=True)
        position[0] += 1

    def replayed() -> None:
        assert graphs is not None and graphs.run([1], [Span(0, 1, position[0], cache)]) is not None
        position[0] += 1

    out: dict[str, Any] = {"eager": _steps_profiled(eager)}
    if graphs is not None:
        replayed()  # the capture
        out["cuda_graphs"] = _steps_profiled(replayed)
    return out


def _steps_profiled(step: Any) -> dict[str, float]:
    """Wall time of ``DECODE_STEPS`` steps against the GPU's busy time in them."""
    from torch.profiler import ProfilerActivity, profile

    def steps() -> None:
        for _ in range(DECODE_STEPS):
            step()

    wall = _synced(steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps()
        torch.cuda.synchronize()
    events = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in events)
    kernels = sum(e.count for e in events if e.self_device_time_total > 0)
    return {
        "decode_step_ms": wall / DECODE_STEPS * 1e3,
        "gpu_busy_ms": busy_us / 1e3 / DECODE_STEPS,
        "launch_share": max(0.0, 1 - busy_us / 1e6 / wall),
        "kernels_per_step": kernels / DECODE_STEPS,
    }


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1])), flush=True)
