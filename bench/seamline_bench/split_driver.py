"""A mesh under measurement: coordinator + fragment server here, stage nodes as processes.

Runs as its own process (so a benchmark can place it inside a network namespace) and takes
commands on stdin: ``measure TOKENS`` prints one JSON line with the decode rate of a greedy
generation through the mesh, as the coordinator receives the tokens; ``quit`` ends it.
Nodes are started by the command lines given with ``--node-cmd`` (``{token}`` is replaced),
or locally when none are given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import threading
import time
from typing import Any

import uvicorn

from seamline.mesh.control.serve import Mesh, ServeOptions, build_mesh, spawn_node, wait_ready
from seamline.net.link import free_port
from seamline.params import SamplingParams
from seamline.runtime.speculation import OFF
from seamline.server.demo import memory_cap_gb
from seamline.server.mesh_app import mesh_app
from seamline.weights.loader import dtype_bytes

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
CONTEXT = 2048


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--node-cmd", action="append", default=[], help="shell command per node, {token}"
    )
    parser.add_argument(
        "--plaintext", action="store_true", help="links without TLS (to measure what TLS costs)"
    )
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    port = free_port(args.host)
    options = ServeOptions(
        host=args.host,
        port=port,
        control_port=free_port(args.host),
        fragments_port=free_port(args.host),
        nodes_expected=args.stages,
        local_node=False,
        context=CONTEXT,
        plaintext_links=args.plaintext,
        model=args.model,
        dtype=args.dtype,
        precision="exact",
        speculation=OFF,
    )  # the single process it is compared with is exact and plain
    mesh = build_mesh(options)
    mesh.start(args.host)
    server = uvicorn.Server(
        uvicorn.Config(mesh_app(mesh), host=args.host, port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    cap = f"{memory_cap_gb(args.model, args.stages, CONTEXT, dtype_bytes(args.dtype)):.3f}"
    if args.node_cmd:
        procs = [
            subprocess.Popen(shlex.split(c.format(token=mesh.token, cap=cap)))
            for c in args.node_cmd
        ]
    else:
        procs = [
            spawn_node(mesh.token, f"node{i}", None, ["--no-progress", "--max-memory", cap])
            for i in range(args.stages)
        ]
    status = wait_ready(mesh.coordinator, timeout_s=600)
    print(json.dumps({"ready": True, "stages": status["stages"]}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "secrets":
            answer = _secrets(mesh, args.host, port)
        elif len(words) > 2:
            answer = asyncio.run(measure_request(mesh, int(words[1]), int(words[2])))
        else:
            answer = asyncio.run(_measure(mesh, int(words[1])))
        print(json.dumps(answer), flush=True)
    for proc in procs:
        proc.terminate()
    server.should_exit = True
    return 0


def _secrets(mesh: Mesh, host: str, port: int) -> dict[str, Any]:
    """What a fuzzer playing a member needs (``bench fuzz``): the plan's link key, a member's
    fragment token, an invite, the state directory (the CA); this process holds them anyway."""
    coordinator = mesh.coordinator
    stages = [(h.node_id, (h.join.data_host, h.join.data_port)) for h in coordinator.pipeline()]
    config = coordinator.options.model_config
    _, invite = coordinator.invites.create(ttl_s=24 * 3600)
    return {
        "api": f"http://{host}:{port}",
        "control": [host, coordinator.invite.control_port],
        "plan_id": coordinator.plan_id,
        "link_key": coordinator.link_key,
        "stages": stages,
        "fragment_token": coordinator.joining.fragment_token(stages[0][0]),
        "invite": invite,
        "state_dir": str(mesh.state_dir),
        "hidden_size": config.hidden_size if config else 0,
    }


def fixed_prompt(length: int, vocab: int) -> list[int]:
    """The same ``length`` token ids in every party of a run."""
    import torch

    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(1)).tolist()


async def measure_request(mesh: Mesh, tokens: int, prompt_tokens: int) -> dict[str, Any]:
    """One whole request through the mesh: a prompt of ``prompt_tokens`` ids, then ``tokens``
    greedy tokens, timed from the request to its last token."""
    config = mesh.coordinator.options.model_config
    assert config is not None
    prompt = fixed_prompt(prompt_tokens, config.vocab_size)
    start = time.perf_counter()
    out = [
        e.token
        async for e in mesh.backend.generate(prompt, SamplingParams(max_tokens=tokens))
        if e.shown
    ]
    return {"seconds": time.perf_counter() - start, "tokens": out}


async def _measure(mesh: Mesh, tokens: int) -> dict[str, Any]:
    """Decode rate as the coordinator sees it, and the share of each token spent computing."""
    backend = mesh.backend
    prompt = backend.codec.encode_chat([{"role": "user", "content": PROMPT}])
    times = []
    before = mesh.coordinator.stage_stats()
    async for _ in backend.generate(prompt, SamplingParams(max_tokens=tokens + 1)):
        times.append(time.perf_counter())
    after = mesh.coordinator.stage_stats()
    steps = len(times) - 1
    decode = times[-1] - times[0]
    # every stage ran one decode step per token (plus one for the last token, not timed here)
    compute = [
        (a.decode_seconds - b.decode_seconds) / (a.decode_steps - b.decode_steps)
        for a, b in zip(after, before)
    ]
    ms_per_token = decode / steps * 1e3
    return {
        "tok_s": steps / decode,
        "ms_per_token": ms_per_token,
        "tokens": steps,
        "compute_ms_per_token": sum(compute) * 1e3,
        "stage_compute_ms": [c * 1e3 for c in compute],
    }


if __name__ == "__main__":
    sys.exit(main())
