"""`seamline demo --nodes N`: a coordinator and N node processes on this machine, one question.

Each node gets its own fragment cache, so each downloads exactly its share of the model.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from seamline.mesh.serve import ServeOptions, build_mesh, spawn_node, wait_ready
from seamline.net.link import free_port


def run_demo(nodes: int, question: str, model: str | None, max_tokens: int, port: int = 0) -> int:
    port = port or free_port()
    options = ServeOptions(model=model, port=port, control_port=free_port(), nodes_expected=nodes, local_node=False)
    print(f"seamline demo: packaging the model and starting a coordinator on port {port}", flush=True)
    mesh = build_mesh(options)
    mesh.coordinator.start(options.host)
    server = uvicorn.Server(uvicorn.Config(mesh.app, host=options.host, port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    with tempfile.TemporaryDirectory(prefix="seamline-demo-") as tmp:
        procs = [spawn_node(mesh.token, f"node{i}", Path(tmp) / f"node{i}", ["--no-progress"]) for i in range(nodes)]
        try:
            status = wait_ready(mesh.coordinator, timeout_s=600)
            _print_plan(status)
            _ask(f"http://127.0.0.1:{port}/v1", mesh.coordinator.model.name, question, max_tokens)
        finally:
            server.should_exit = True
            for proc in procs:
                proc.terminate()
    return 0


def _print_plan(status: dict[str, object]) -> None:
    print("plan:", flush=True)
    for stage in status["stages"]:  # type: ignore[attr-defined]
        start, end = stage["layers"]
        extras = [name for name in ("embedding", "head") if stage[name]]
        print(f"  {stage['node_id']:>8}: layers [{start:>2},{end:>2}) {' + '.join(extras)}", flush=True)
    print(f"  predicted {status['predicted_ms_per_token']:.1f} ms/token", flush=True)


def _ask(base: str, model: str, question: str, max_tokens: int) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
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
