"""`seamline demo --nodes N`: a coordinator and N node processes on this machine, one question.

Each node gets its own fragment cache, so each downloads exactly its share of the model.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import uvicorn

if TYPE_CHECKING:
    from seamline.mesh.plan.types import ModelSpec, NodeInfo, PlanOptions

from seamline.mesh.control.serve import ServeOptions, build_mesh, spawn_node, wait_ready
from seamline.net.http_guard import bounded
from seamline.net.link import free_port
from seamline.server.mesh_app import mesh_app

DEMO_CONTEXT = 2048


def run_demo(
    nodes: int,
    question: str,
    model: str | None,
    max_tokens: int,
    port: int = 0,
    tensor_parallel: int = 0,
    precision: str = "fast",
    dtype: str | None = None,
) -> int:
    port = port or free_port()
    options = ServeOptions(
        model=model,
        port=port,
        control_port=free_port(),
        fragments_port=free_port(),
        nodes_expected=nodes,
        precision=precision,
        dtype=dtype,
        local_node=False,
        context=DEMO_CONTEXT,
        tensor_parallel=tensor_parallel,
    )
    print(
        f"seamline demo: packaging the model and starting a coordinator on port {port}", flush=True
    )
    mesh = build_mesh(options)
    mesh.start(options.host)
    server = uvicorn.Server(
        uvicorn.Config(
            mesh_app(mesh), host=options.host, port=port, log_level="warning", **bounded()
        )
    )
    threading.Thread(target=server.run, daemon=True).start()
    with tempfile.TemporaryDirectory(prefix="seamline-demo-") as tmp:
        # stage split: cap each node below the whole model; lockstep ranks share every layer anyway
        cap = (
            memory_cap_gb(model, nodes, DEMO_CONTEXT) if nodes > 1 and not tensor_parallel else None
        )
        if cap is not None:
            print(f"each node may use {cap:.2f} GB: none can hold the whole model", flush=True)
        extra = ["--no-progress"] + (["--max-memory", f"{cap:.3f}"] if cap else [])
        # lockstep ranks meet at every gate: on one machine each gets its share of the cores,
        # or their OpenMP workers fight over them (pipeline stages take turns, so they keep all)
        threads = max(1, (os.cpu_count() or 1) // nodes) if tensor_parallel else 0
        procs = [
            spawn_node(mesh.token, f"node{i}", Path(tmp) / f"node{i}", extra, threads)
            for i in range(nodes)
        ]
        try:
            status = wait_ready(mesh.coordinator, timeout_s=600)
            _print_plan(status)
            _ask(f"http://127.0.0.1:{port}/v1", mesh.coordinator.model.name, question, max_tokens)
        finally:
            server.should_exit = True
            mesh.coordinator.shut_down()
            for proc in procs:
                proc.terminate()
    return 0


def _print_plan(status: dict[str, object]) -> None:
    print("plan:", flush=True)
    for stage in status["stages"]:  # type: ignore[attr-defined]
        start, end = stage["layers"]
        extras = [name for name in ("embedding", "head") if stage[name]]
        ranks = stage.get("ranks", [stage["node_id"]])
        group = f" in lockstep with {', '.join(ranks[1:])}" if len(ranks) > 1 else ""
        print(
            f"  {stage['node_id']:>8}: layers [{start:>2},{end:>2}) {' + '.join(extras)}{group}",
            flush=True,
        )
    print(f"  predicted {status['predicted_ms_per_token']:.1f} ms/token", flush=True)
    precision = status["precision"]
    print(
        f"  precision {precision['name']}: {precision['label']} (--precision exact for float32)",
        flush=True,
    )  # type: ignore[index]


def _ask(base: str, model: str, question: str, max_tokens: int) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    print(f"question: {question}\nanswer: ", end="", flush=True)
    start, first, tokens = time.perf_counter(), 0.0, 0
    with httpx.stream("POST", f"{base}/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and not first:
                    first = time.perf_counter()
                print(piece, end="", flush=True)
    elapsed = time.perf_counter() - (first or start)
    rate = (tokens - 1) / elapsed if tokens > 1 and elapsed > 0 else 0.0
    print(f"\n{tokens} tokens, {rate:.1f} tokens/s after the first token", flush=True)


def memory_cap_gb(
    model: str | None,
    stages: int,
    context: int,
    dtype_bytes: int = 4,
    ranks: int = 1,
    within: float = 0.5,
    mtp: bool = True,
) -> float:
    """A per-node memory cap under which the planner needs exactly ``stages`` stages of
    ``ranks`` equal nodes each (lockstep groups when ``ranks`` > 1). ``mtp``: the mesh drafts
    with the checkpoint's multi-token-prediction layer where it has one (``--speculative`` auto
    or mtp), which its last stage holds.

    By default the middle (``within``: 0 the least, 1 the most) of the range of caps under which
    that many nodes plan that many stages and one stage fewer cannot hold the model: no node can
    hold more than its share, which is the situation the mesh exists for (and a mesh that loses
    one of them cannot serve alone). Near the least, each node holds about its even share.
    """
    from seamline.app import default_model_path
    from seamline.config import ModelConfig
    from seamline.mesh.plan.groups import kv_divides, plan_groups
    from seamline.mesh.plan.types import ModelSpec, NodeInfo, PlanError, PlanOptions
    from seamline.weights.loader import mtp_missing, open_source

    source = open_source(model or default_model_path())
    config = ModelConfig.from_hf_dict(source.config_dict())
    names = source.names()
    shapes, types = {n: source.shape(n) for n in names}, {n: source.stored_type(n) for n in names}
    drafts = (
        mtp and mtp_missing(source, config, embed=True) is None
    )  # packaged with the layer: serve drafts with it
    spec = ModelSpec.from_checkpoint_shapes(
        config, "cap", shapes, dtype_bytes, types, context, drafts
    )
    options = PlanOptions(context_tokens=context)
    whole = spec.weight_bytes() + sum(spec.layer_kv()) * context
    fitting = []
    for step in range(1, 400):
        cap = int(whole * 2 * step / 400) + options.headroom_bytes
        nodes = [NodeInfo(f"n{i}", cap, 1e10) for i in range(stages * ranks)]
        try:
            if (
                len(
                    plan_groups(spec, nodes, None, options, ranks, kv_divides(config, ranks)).stages
                )
                != stages
            ):
                continue
        except PlanError:
            continue
        if stages > 1 and _holds(
            spec, nodes[: (stages - 1) * ranks], options, ranks, kv_divides(config, ranks)
        ):
            continue
        fitting.append(cap)
    if not fitting:
        raise ValueError(f"no memory cap makes {stages} equal nodes split this model")
    return (fitting[0] + within * (fitting[-1] - fitting[0])) / (1 << 30)


def _holds(
    spec: ModelSpec, nodes: list[NodeInfo], options: PlanOptions, ranks: int, kv_split: bool
) -> bool:
    """Whether ``nodes`` can hold the whole model in some plan."""
    from seamline.mesh.plan.groups import plan_groups
    from seamline.mesh.plan.types import PlanError

    try:
        plan_groups(spec, nodes, None, options, ranks, kv_split)
        return True
    except PlanError:
        return False
