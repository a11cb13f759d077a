"""`seamline bench gpu`: seamline on a CUDA GPU, as a user runs it (`--device cuda`, no other flag).

For each model of ``gpu_models`` (the embedded model's shapes, and `bench quant`'s 1.1B in
Q4_K_M, random weights): ``gpu_probe`` in a fresh process (GPU memory against the GGUF's
tensor bytes, prefill rate, the share of a decode step spent launching kernels), then a
`serve --single --device cuda` server under the real `openai` client: decode tok/s of one
stream, and the aggregate rate of 16 and 64 concurrent streams (``bench.load``). Last, a
2-stage mesh of one `--device cpu` node and one `--device cuda` node on the embedded shapes:
its single-stream rate beside the GPU-only server's. Without CUDA it says so and measures
nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

import torch

from seamline_bench.gpu_models import gpu_models
from seamline_bench.load import make_prompts, run_wave
from seamline_bench.servers import NodeSpec, Server, start_mesh, start_single

CLIENTS = (1, 16, 64)
SERVER_THREADS = 4
TARGETS = {"llama_1b.decode_tok_s_1": 300.0, "llama_1b.aggregate_tok_s_64": 2000.0}
MEMORY_TARGET = 1.25  # weights on the GPU over the GGUF's tensor bytes, at most


def bench_gpu(tokens: int = 64) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {
            "bench": "gpu",
            "unavailable": "torch sees no CUDA device here: GPU path unverified on a device",
        }
    models = gpu_models()
    logs = Path(tempfile.mkdtemp(prefix="seamline-bench-gpu-"))
    out: dict[str, Any] = {}
    for name, path in models.items():
        out[name] = {"probe": _probe(path), **_api_rates(name, path, tokens, logs)}
        _say(name, out[name])
    out["mixed_mesh"] = _mixed_mesh(
        models["embedded"], tokens, logs, out["embedded"]["decode_tok_s_1"]
    )
    _say("mixed_mesh", out["mixed_mesh"])
    figures = {
        "llama_1b.decode_tok_s_1": out["llama_1b"]["decode_tok_s_1"],
        "llama_1b.aggregate_tok_s_64": out["llama_1b"]["aggregate_tok_s_64"],
    }
    ratio = out["llama_1b"]["probe"]["memory"]["weights_ratio"]
    met = {key: value >= TARGETS[key] for key, value in figures.items()} | {
        "llama_1b.weights_ratio": ratio <= MEMORY_TARGET
    }
    return {
        "bench": "gpu",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": tokens,
        "models": out,
        "targets": {**TARGETS, "llama_1b.weights_ratio_max": MEMORY_TARGET},
        "targets_met": met,
    }


def _say(name: str, figures: dict[str, Any]) -> None:
    """Each part's figures as they come, on stderr: a run stopped at its time limit keeps them."""
    print(json.dumps({name: figures}), file=sys.stderr, flush=True)


def _probe(path: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "seamline_bench.gpu_probe", str(path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _prompts(path: Path, count: int) -> list[str]:
    from seamline.text import TextCodec

    codec = TextCodec.from_model(path, ())
    return make_prompts(count, 24, 48, 7, codec.encode)


def _waves(
    server: Server, path: Path, tokens: int, clients: tuple[int, ...]
) -> dict[int, dict[str, Any]]:
    prompts = _prompts(path, max(clients))
    asyncio.run(run_wave(server.url, server.model, prompts[:1], 8))  # warm-up: the kernels compile
    asyncio.run(run_wave(server.url, server.model, prompts[: max(clients)], 8))
    return {
        n: asyncio.run(run_wave(server.url, server.model, prompts[:n], tokens)) for n in clients
    }


def _api_rates(name: str, path: Path, tokens: int, logs: Path) -> dict[str, Any]:
    server = start_single(
        f"gpu-{name}",
        SERVER_THREADS,
        dict(os.environ),
        logs,
        precision=None,
        model=path,
        extra=("--device", "cuda"),
    )
    try:
        server.wait_healthy()
        waves = _waves(server, path, tokens, CLIENTS)
    finally:
        server.close()
    single = waves[1]
    return {
        "decode_tok_s_1": median(single["decode_tok_s"]) if single["decode_tok_s"] else 0.0,
        "ttft_ms_1": median(single["ttft_ms"]) if single["ttft_ms"] else None,
        **{f"aggregate_tok_s_{n}": waves[n]["tok_s"] for n in CLIENTS if n > 1},
        "failed": sum(w["failed"] for w in waves.values()),
        "errors": [e for w in waves.values() for e in w["errors"]][:3],
    }


def half_node_cap_gb(cap_gb: float) -> float:
    """A ``--max-memory`` under which a GPU node holds what a node capped at ``cap_gb`` holds, half
    on its GPU and half in its memory: the planner keeps 256 MiB of headroom on each of the two
    (``PlanOptions.headroom_bytes``), so the node needs both halves and the mesh both nodes."""
    headroom = 0.25
    return headroom + (cap_gb - headroom) / 2


def _mixed_mesh(path: Path, tokens: int, logs: Path, gpu_alone: float) -> dict[str, Any]:
    from seamline.server.demo import memory_cap_gb

    cap = memory_cap_gb(str(path), 2, 2048, dtype_bytes=2)
    nodes = [
        NodeSpec("0-3", 4, device="cpu"),
        NodeSpec("4-7", 4, device="cuda", max_memory_gb=half_node_cap_gb(cap)),
    ]
    server = start_mesh(
        "gpu-mixed",
        nodes,
        NodeSpec("8-9", 2),
        "127.0.0.1",
        {**os.environ},
        logs,
        cap,
        ("--model", str(path)),
        precision=None,
    )
    try:
        server.wait_healthy()
        stages = _stages(server)
        waves = _waves(server, path, tokens, (1,))
    finally:
        server.close()
    rate = median(waves[1]["decode_tok_s"]) if waves[1]["decode_tok_s"] else 0.0
    return {
        "stages": stages,
        "decode_tok_s_1": rate,
        "gpu_alone_tok_s_1": gpu_alone,
        "ratio_to_gpu_alone": rate / gpu_alone if gpu_alone else None,
    }


def _stages(server: Server) -> list[dict[str, Any]]:
    import httpx

    status = httpx.get(server.url.removesuffix("/v1") + "/api/status", timeout=10).json()
    return [
        {k: s.get(k) for k in ("node_id", "layers", "device", "gpu_layers")}
        for s in status.get("stages", [])
    ]
