"""`seamline bench split`: the single-process engine against a 2-stage mesh of two processes.

Same model (the embedded SmolLM2, float32), same prompt, same run, alternating: (a) a mesh on
loopback, (b) a mesh whose two nodes sit in two network namespaces joined by an emulated
1 GbE link (0.25 ms one-way, 1 gbit, via shared/netns.sh; needs root and iptables). The
mesh's decode rate is taken where the coordinator receives the tokens.

Per token the loop crosses the wire twice (hidden state forward, token id back), so
``hop_overhead_ms`` = (split − single) / 2 per boundary crossing: on loopback, and on the
LAN after subtracting the link's own one-way delay. Meshes run over mutual TLS; one loopback
mesh runs its links in plaintext beside it, so ``hop_overhead_ms`` (plaintext) and
``hop_overhead_ms_tls`` come from the same runs; their difference is ``tls_ms_per_hop_mesh``.
``tls_ms_per_hop`` is what TLS adds to one frame's send and receive alone (``tls_hop``): the
whole meshes' per-token times spread by more than that here.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from seamline.app import LocalModel
from seamline.params import SamplingParams
from seamline.runtime.sampling import sample
from seamline_bench.driver import Driver, median
from seamline_bench.single import PROMPT
from seamline_bench.tls_hop import tls_per_hop

LAN_DELAY_MS = 0.25
LAN_RATE = "1gbit"
NS_PREFIX = "slb"


RUNS = (
    "single",
    "loopback",
    "loopback_tls",
    "lan",
    "single_1core",
    "split_1core_each",
    "lan_1core_each",
)


def _driver(args: list[str], prefix: list[str] | None = None) -> Driver:
    """A split_driver process (a mesh), ready: meshes start one after another, not together."""
    driver = Driver("seamline_bench.split_driver", args, prefix)
    driver.wait_ready()
    return driver


def pinned_driver(extra: tuple[str, ...] = ()) -> Driver:
    """Two nodes, each pinned to its own core with one thread: two one-core machines."""
    join = f"{sys.executable} -m seamline.cli join {{token}} --quiet --no-progress --max-memory {{cap}}"
    nodes = [
        f"env OMP_NUM_THREADS=1 taskset -c {core} {join} --node-id core{core}" for core in (0, 1)
    ]
    return _driver([*extra, *(a for n in nodes for a in ("--node-cmd", n))])


def pinned_single(model: LocalModel, prompt: list[int], tokens: int) -> dict[str, float]:
    """The single engine on one core with one thread, to compare with ``pinned_driver``."""
    with one_core():
        return decode_single(model, prompt, tokens)


@contextmanager
def one_core() -> Iterator[None]:
    """This process on core 0 with one torch thread, while inside."""
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)


def netns_script() -> Path | None:
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent.parent / "shared" / "netns.sh"
        if candidate.is_file():
            return candidate
    return None


def lan_up(delay_ms: float = LAN_DELAY_MS) -> str:
    """Bring up the two namespaces (``delay_ms`` one way); return why not, or "" when they are up."""
    script = netns_script()
    if script is None or os.geteuid() != 0 or shutil.which("iptables-legacy") is None:
        return "needs root, iptables (apt-get install iptables) and shared/netns.sh"
    env = {**os.environ, "PFX": NS_PREFIX, "PYTHON": sys.executable}
    subprocess.run(["bash", str(script), "down"], env=env, capture_output=True)
    subprocess.run(
        ["bash", str(script), "up", "2", str(delay_ms), LAN_RATE],
        env=env,
        check=True,
        capture_output=True,
    )
    return ""


def lan_driver(one_core_each: bool = False, extra: tuple[str, ...] = ()) -> Driver:
    """A mesh whose two nodes sit in the two namespaces (the coordinator beside the first).

    ``one_core_each``: each node pinned to its own core with one thread.
    """
    join = f"{sys.executable} -m seamline.cli join {{token}} --quiet --no-progress --max-memory {{cap}}"
    pins = (
        ["env OMP_NUM_THREADS=1 taskset -c 0 ", "env OMP_NUM_THREADS=1 taskset -c 1 "]
        if one_core_each
        else ["", ""]
    )
    tag = "core" if one_core_each else "ns"
    nodes = [
        f"{pins[0]}{join} --node-id {tag}1",
        f"ip netns exec {NS_PREFIX}2 {pins[1]}{join} --node-id {tag}2",
    ]
    args = ["--host", "10.77.0.1", *extra, *[a for n in nodes for a in ("--node-cmd", n)]]
    return _driver(args, prefix=["ip", "netns", "exec", f"{NS_PREFIX}1"])


def lan_down() -> None:
    script = netns_script()
    if script is not None:
        env = {**os.environ, "PFX": NS_PREFIX}
        subprocess.run(["bash", str(script), "down"], env=env, capture_output=True)


def decode_single(model: LocalModel, prompt: list[int], tokens: int) -> dict[str, float]:
    """The single-process engine's greedy decode: wall and layer-compute time per token."""
    stage, params = model.engine.stage, SamplingParams()
    cache = stage.new_cache()
    token, position = (
        sample(model.engine.prefill(prompt, cache), params, 0, len(prompt)),
        len(prompt),
    )
    compute = 0.0
    start = time.perf_counter()
    for _ in range(tokens):
        began = time.perf_counter()
        logits = stage(torch.tensor([token]), position, cache, last_only=True)
        compute += time.perf_counter() - began
        position += 1
        token = sample(logits[-1], params, 0, position)
    wall = time.perf_counter() - start
    return {
        "tok_s": tokens / wall,
        "ms_per_token": wall / tokens * 1e3,
        "compute_ms_per_token": compute / tokens * 1e3,
    }


def bench_split(repeats: int = 5, tokens: int = 128, v4: bool = True) -> dict[str, Any]:
    """The JSON of `seamline bench split`; ``v4``: with the DeepSeek-V4 rows (``split_v4``)."""
    model = LocalModel.load(context=2048)
    prompt = model.codec.encode_chat([{"role": "user", "content": PROMPT}])
    loopback, loopback_tls, pinned = _driver(["--plaintext"]), _driver([]), pinned_driver()
    lan_reason = lan_up()
    lan = lan_driver() if not lan_reason else None
    lan_pinned = lan_driver(one_core_each=True) if not lan_reason else None
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in RUNS}
    drivers = {
        "loopback": loopback,
        "loopback_tls": loopback_tls,
        "lan": lan,
        "split_1core_each": pinned,
        "lan_1core_each": lan_pinned,
    }
    try:
        decode_single(model, prompt, 8)  # warm-up
        for driver in drivers.values():
            if driver is not None:
                driver.measure(8)
        for _ in range(repeats):
            runs["single"].append(decode_single(model, prompt, tokens))
            runs["single_1core"].append(pinned_single(model, prompt, tokens))
            for name, driver in drivers.items():
                if driver is not None:
                    runs[name].append(driver.measure(tokens))
        for driver in drivers.values():
            if driver is not None:
                driver.close()
        result = _result(
            runs, tokens, repeats, model.config.hidden_size, loopback.wait_ready(), lan_reason
        )
        if v4:
            from seamline_bench.split_v4 import bench_split_v4

            result.update(bench_split_v4(repeats, lan_reason))
        return result
    finally:
        for driver in drivers.values():
            if driver is not None:
                driver.close()
        lan_down()


def _frame_bytes(hidden: int) -> int:
    """Bytes on the wire for one decode step's hidden-state frame (header, row record, tensor, id)."""
    import torch

    from seamline.net.frames import Row, encode_hidden

    buffers = encode_hidden(
        [Row(1, 0, 1, 0, 0, 0)], torch.zeros(1, hidden), torch.zeros(1, dtype=torch.long)
    )
    return sum(len(b) if isinstance(b, bytes) else b.nbytes for b in buffers)


def _glue_ms(runs: list[dict[str, Any]]) -> float:
    """Time per token outside the layers' compute: sampling, embedding glue, and the wire."""
    return statistics.median(
        float(r["ms_per_token"]) - float(r["compute_ms_per_token"]) for r in runs
    )


def _result(
    runs: dict[str, list[dict[str, Any]]],
    tokens: int,
    repeats: int,
    hidden: int,
    ready: dict[str, Any],
    lan_reason: str,
) -> dict[str, Any]:
    single, loop = median(runs["single"], "tok_s"), median(runs["loopback"], "tok_s")
    lan = median(runs["lan"], "tok_s") if runs["lan"] else None
    glue = _glue_ms(runs["single"])
    crossings = 2  # per token: the hidden state forward, the token id back
    return {
        "bench": "split",
        "model": "SmolLM2-135M-Instruct.Q4_1 (float32)",
        "tokens": tokens,
        "repeats": repeats,
        "stages": [s["layers"] for s in ready["stages"]],
        "single_tok_s": round(single, 2),
        "split_loopback_tok_s": round(loop, 2),  # plaintext links
        "split_lan_tok_s": round(lan, 2) if lan else None,
        "ratio_loopback": round(loop / single, 3),
        "ratio_lan": round(lan / single, 3) if lan else None,
        # per boundary crossing: the mesh's time outside layer compute, less the single engine's
        "hop_overhead_ms": round(
            (_glue_ms(runs["loopback"]) - glue) / crossings, 3
        ),  # plaintext links
        "hop_overhead_ms_tls": round((_glue_ms(runs["loopback_tls"]) - glue) / crossings, 3),
        "tls_ms_per_hop_mesh": round(
            (_glue_ms(runs["loopback_tls"]) - _glue_ms(runs["loopback"])) / crossings, 3
        ),
        **tls_per_hop(hidden),
        "split_loopback_tls_tok_s": round(median(runs["loopback_tls"], "tok_s"), 2),
        "hop_overhead_lan_ms": round((_glue_ms(runs["lan"]) - glue) / crossings - LAN_DELAY_MS, 3)
        if lan
        else None,
        "compute_ms_per_token": {
            k: round(median(v, "compute_ms_per_token"), 2) for k, v in runs.items() if v
        },
        # two one-core machines against one: each node pinned to its own core, one thread
        "single_1core_tok_s": round(median(runs["single_1core"], "tok_s"), 2),
        "split_1core_each_tok_s": round(median(runs["split_1core_each"], "tok_s"), 2),
        "ratio_1core_each": round(
            median(runs["split_1core_each"], "tok_s") / median(runs["single_1core"], "tok_s"), 3
        ),
        "split_lan_1core_each_tok_s": round(median(runs["lan_1core_each"], "tok_s"), 2)
        if lan
        else None,
        "ratio_lan_1core_each": round(
            median(runs["lan_1core_each"], "tok_s") / median(runs["single_1core"], "tok_s"), 3
        )
        if lan
        else None,
        "bytes_per_token_per_boundary": _frame_bytes(hidden),
        "runs_tok_s": {k: [round(float(r["tok_s"]), 2) for r in v] for k, v in runs.items()},
        "lan_link": f"{LAN_DELAY_MS} ms one-way, {LAN_RATE}"
        if lan
        else f"not measured: {lan_reason}",
    }
