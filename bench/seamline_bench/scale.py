"""`seamline bench scale`: the cost model's predictions beside what the meshes measure, in one run.

Every configuration serves the embedded model with no flag (``--speculative off``), the
coordinator and the load generator on core 0, each node with one thread:

* ``one_node``: one node on core 0;
* ``two_stages``: node 0 on core 0, node 1 on core 1, over loopback;
* ``two_stages_lan``: the same, each node in its own network namespace over the emulated 1 GbE
  link (0.25 ms one way, 1 Gbit/s; needs root and iptables, else left out and said why);
* ``lockstep_2``: node 0 on core 0 and node 1 on core 1 as one 2-rank lockstep group
  (``--tensor-parallel 2``) over loopback.

Each mesh is left idle until its stages have probed again on quiet cores (their loading probes
ran beside the other meshes' loading; three probes a while apart, their median), before it
settles and again after (the lockstep group, which keeps its loading probe, loads once the
others are idle); once settled, its plan is held (the administration API: no re-balance inside
a measured round). Each is measured at 1, 16 and 64 streaming clients (prompts of 32-256
tokens, ``tokens`` generated with ``ignore_eos``: ``bench throughput``'s load); ``repeats`` (3)
rounds alternate the configurations and a figure is the median over rounds. Each round has new
prompts (the same for every configuration): a round's prompts again would find their prefixes
cached.

The prediction for each configuration and client count is the simulator's (``seamline.sim``)
over probes taken before the load (``calibration`` in the JSON):

* each stage's step probe (``step_probe_ms``: one step of 1, 8, 16, 32 and 64 decode rows, which the
  node measures on its loaded stage before it serves; a lockstep group's leader runs its probe
  through the whole group, every rank's shard and the gates between them);
* each stage's steps outside their forwards (``step_overhead_ms``: taking rows in, scheduling,
  sampling, coding and sending, at one row and at many), which the node times while it serves
  the warm-up waves;
* each hop's round trip and bandwidth, as the nodes measured them;
* the front's CPU per streamed token and per request: the coordinator's and the load
  generator's CPU seconds over warm-up waves, on core 0, with the stage whose node the plan put
  there (``front_node``: not always stage 0 over the emulated link, where either node may come
  first).

``pipeline_gain_64`` (loopback) and ``pipeline_gain_lan_64`` are two stages' tok/s over one
node's at 64 clients, and ``pipeline_gain_bound_64`` what the batched kernels allow them: one
node's step of 64 rows over its step of 32 (two stages step micro-batches of 32 rows);
``ratio_min``/``ratio_max`` span predicted / measured over every configuration and client count;
``seed_check_tok_s`` is the seed's own setup priced by the same model (``seamline.sim.seed_setup``).
Beside each ``predicted_busy``, ``measured_busy``: each stage's forwards over the wave's wall time
(the front's core also runs its stage, whose forwards' share is then less than its core's; a
predicted share counts the front's work on that core).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from seamline_bench.scale_calibration import Calibration, calibrate, predict, status_of
from seamline_bench.servers import NodeSpec, Server, start_mesh
from seamline_bench.split import LAN_DELAY_MS, NS_PREFIX, lan_down, lan_up
from seamline_bench.throughput import prompts_file, seamline_env, wave

CLIENTS = (1, 16, 64)
TOKENS = 64
SETTLE_CLIENTS, SETTLE_TOKENS, SETTLE_WAVES, STABLE_WAVES = 64, 48, 8, 2
PROBE_WAIT_S, PROBE_POLL_S = 300.0, 10.0
REPROBE = (
    "--reprobe-when-idle",
)  # nodes probe again on quiet cores: the meshes load beside each other
TARGETS = {
    "ratio_low": 0.85,
    "ratio_high": 1.15,
    "pipeline_gain_64": 1.7,
    "pipeline_gain_lan_64": 1.6,
}


def bench_scale(
    repeats: int = 3, tokens: int = TOKENS, clients: tuple[int, ...] = CLIENTS
) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="seamline-scale-"))
    lan_reason = lan_up(LAN_DELAY_MS)
    servers: dict[str, Server] = {}
    try:
        for name in ("one_node", "two_stages", *(() if lan_reason else ("two_stages_lan",))):
            servers[name] = _start(name, logs)
            servers[name].wait_healthy()
        wait_quiet_probes(
            servers
        )  # the plans are made from probes taken beside the others' loading
        # a group keeps the first probe it takes, once idle after it is linked (its leader cannot
        # see its ranks' cores quiet): it loads once the others are idle
        servers["lockstep_2"] = _start("lockstep_2", logs)
        servers["lockstep_2"].wait_healthy()
        settled = {name: settle(server, logs) for name, server in servers.items()}
        for (
            name,
            server,
        ) in servers.items():  # a switch inside a measured round would replay its requests
            hold_plan(server, logs / f"state-{name}")
        quiet = wait_quiet_probes(servers)  # a re-balance reloaded stages: their probes again
        del quiet["lockstep_2"]  # a group's: its first probe, the other meshes idle
        calibrations = {"one_node": calibrate(servers["one_node"], logs)}
        rank_probe = calibrations["one_node"].stages[
            0
        ]  # the same core kind: a rank's rate reading weights
        calibrations |= {
            name: calibrate(server, logs, rank_probe)
            for name, server in servers.items()
            if name != "one_node"
        }
        measured = _measure(servers, repeats, tokens, clients, logs)
        plans = {
            name: {"settled": settled[name], "after": _plan_of(server)}
            for name, server in servers.items()
        }
    finally:
        for server in servers.values():
            server.close()
        if not lan_reason:
            lan_down()
    predicted = {
        name: {
            n: [
                predict(calibrations[name], n, tokens, _prompt_lengths(n, r, logs))
                for r in range(repeats)
            ]
            for n in clients
        }
        for name in servers
    }
    result = _result(measured, predicted, calibrations, tokens, repeats, lan_reason, logs)
    return result | {"plans": plans, "probes_quiet": quiet}


def wait_quiet_probes(
    servers: dict[str, Server], timeout_s: float = PROBE_WAIT_S
) -> dict[str, bool]:
    """Leave every mesh idle until each of its stages has taken its probe again on quiet cores
    (``mesh.node.reprobe``; a lockstep group's keeps its first probe); per mesh, whether all
    did within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pending = set(servers)
    while pending and time.monotonic() < deadline:
        time.sleep(
            PROBE_POLL_S
        )  # seldom: each look starts a process, on one of the cores being probed
        pending = {name for name in pending if not _probed_quiet(servers[name])}
    return {name: name not in pending for name in servers}


def _probed_quiet(server: Server) -> bool:
    stages = status_of(server)["stages"]
    return all(
        stage.get("probe_quiet")
        or (len(stage.get("ranks") or ()) > 1 and stage.get("step_probe_ms"))
        for stage in stages
    )  # a group's: its first probe, taken once idle after it was linked


def settle(server: Server, logs: Path) -> dict[str, Any]:
    """Load the mesh until ``STABLE_WAVES`` waves running pass with no change of plan and the
    coordinator's re-balance (``mesh.control.balance``: it re-plans stages that measure apart
    under load, deciding every few loaded windows) has kept the serving plan in a decision of
    its own (``balance_settled``), ``SETTLE_WAVES`` at most: the plan it serves then."""
    stable = 0
    for attempt in range(SETTLE_WAVES):
        before = _plan_of(server)
        wave(server, prompts_file(SETTLE_CLIENTS, 8000 + attempt, logs), SETTLE_TOKENS)
        after = _plan_of(server)
        stable = stable + 1 if after == before else 0
        if stable >= STABLE_WAVES and status_of(server).get("balance_settled", True):
            return after | {"waves": attempt + 1}
        wait_ready(server)
    return _plan_of(server) | {"waves": SETTLE_WAVES}


def hold_plan(server: Server, state_dir: Path) -> None:
    """Hold the mesh's serving plan (its administration API): no re-balance from here on."""
    url = server.url.removesuffix("/v1") + "/api/admin/balance"
    key = (state_dir / "admin.key").read_text().strip()
    code = (
        "import httpx,os,sys; httpx.put(sys.argv[1], json={'hold': True}, timeout=30, "
        "headers={'Authorization': 'Bearer ' + os.environ['ADMIN_KEY']}).raise_for_status()"
    )
    subprocess.run(
        [*server.client_prefix, sys.executable, "-c", code, url],
        timeout=60,
        check=True,
        env={**os.environ, "ADMIN_KEY": key},
    )


def _plan_of(server: Server) -> dict[str, Any]:
    status = status_of(server)
    return {
        "plan_id": status["plan_id"],
        "stages": [s["layers"] for s in status["stages"]],
        "rate_corrections": status.get("rate_corrections", {}),
    }


def wait_ready(server: Server, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if status_of(server).get("ready"):
            return
        time.sleep(0.5)
    raise TimeoutError(f"{server.name} did not serve again within {timeout_s:.0f} s")


def _start(name: str, logs: Path) -> Server:
    from seamline.server.demo import memory_cap_gb

    env = seamline_env()
    own_state = (
        "--state-dir",
        str(logs / f"state-{name}"),
    )  # its administrator's key, to hold its plan
    if name == "one_node":
        core0 = NodeSpec("0", 1, join_extra=REPROBE)
        return _on_core0(
            start_mesh(
                name, [core0], core0, "127.0.0.1", env, logs, None, own_state, precision=None
            )
        )
    cap = memory_cap_gb(None, 2, 2048, dtype_bytes=2)  # any two nodes, and no one, hold the model
    if name in ("two_stages", "lockstep_2"):
        nodes = [NodeSpec("0", 1, join_extra=REPROBE), NodeSpec("1", 1, join_extra=REPROBE)]
        lockstep = name == "lockstep_2"  # every rank could hold the model: the flag makes the group
        return _on_core0(
            start_mesh(
                name,
                nodes,
                NodeSpec("0", 1),
                "127.0.0.1",
                env,
                logs,
                None if lockstep else cap,
                (*own_state, *(("--tensor-parallel", "2") if lockstep else ())),
                precision=None,
            )
        )
    nodes = [NodeSpec(str(i), 1, f"{NS_PREFIX}{i + 1}", join_extra=REPROBE) for i in range(2)]
    coordinator = NodeSpec("0", 1, f"{NS_PREFIX}1")
    return _on_core0(
        start_mesh(name, nodes, coordinator, "10.77.0.1", env, logs, cap, own_state, precision=None)
    )


def _on_core0(server: Server) -> Server:
    server.client_cores = "0"
    return server


def _measure(
    servers: dict[str, Server], repeats: int, tokens: int, clients: tuple[int, ...], logs: Path
) -> dict[str, dict[int, list[dict[str, Any]]]]:
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {
        name: {n: [] for n in clients} for name in servers
    }
    for round_ in range(repeats):
        for n in clients:
            # new prompts each round (a round's prompts again would hit the prefix cache); the same
            # across configurations; each round's prediction takes its prompts' lengths
            prompts = prompts_file(n, _seed(n, round_), logs)
            for name, server in servers.items():
                before = _busy_s(server)
                done = wave(server, prompts, tokens)
                done["busy"] = [
                    (b1 - b0) / done["wall_s"] for b0, b1 in zip(before, _busy_s(server))
                ]
                runs[name][n].append(done)
                print(f"round {round_} {name} {n} clients: {done['tok_s']:.1f} tok/s", flush=True)
    return runs


def _busy_s(server: Server) -> list[float]:
    """Each stage's forwards' seconds so far (a lockstep group's: its leader's)."""
    return [float(stage.get("busy_seconds", 0.0)) for stage in status_of(server)["stages"]]


def _seed(clients: int, round_: int) -> int:
    return 500 + clients + 1000 * round_


def _prompt_lengths(count: int, round_: int, logs: Path) -> tuple[int, ...]:
    from seamline.app import default_model_path
    from seamline.text import TextCodec

    codec = TextCodec.from_model(default_model_path(), ())
    texts = json.loads((logs / f"prompts-{_seed(count, round_)}-{count}.json").read_text())
    return tuple(len(codec.encode(text)) for text in texts)


def _result(
    measured: dict[str, dict[int, list[dict[str, Any]]]],
    predicted: dict[str, dict[int, list[dict[str, Any]]]],
    calibrations: dict[str, Calibration],
    tokens: int,
    repeats: int,
    lan_reason: str,
    logs: Path,
) -> dict[str, Any]:
    from seamline.sim.seed_setup import seed_check

    configs: dict[str, Any] = {}
    ratios = []
    for name, by_clients in measured.items():
        configs[name] = {}
        for n, waves in by_clients.items():
            tok_s = statistics.median(w["tok_s"] for w in waves)
            guesses = predicted[name][n]
            guess = {
                key: statistics.median(g[key] for g in guesses)
                for key in ("tok_s", "ttft_s", "itl_ms")
            }
            guess["busy"] = [statistics.median(b) for b in zip(*(g["busy"] for g in guesses))]
            ratio = guess["tok_s"] / tok_s
            ratios.append(ratio)
            configs[name][str(n)] = {
                "measured_tok_s": round(tok_s, 2),
                "predicted_tok_s": round(guess["tok_s"], 2),
                "ratio": round(ratio, 3),
                "runs_tok_s": [round(w["tok_s"], 2) for w in waves],
                "predicted_runs_tok_s": [round(g["tok_s"], 2) for g in guesses],
                "measured_ttft_p50_ms": round(
                    statistics.median(_p50(w["ttft_ms"]) for w in waves), 1
                ),
                "predicted_ttft_p50_ms": round(guess["ttft_s"] * 1e3, 1),
                "measured_itl_p50_ms": round(
                    statistics.median(_p50(w["itl_ms"]) for w in waves), 2
                ),
                "predicted_itl_p50_ms": round(guess["itl_ms"], 2),
                "predicted_busy": [round(b, 3) for b in guess["busy"]],
                "measured_busy": [
                    round(statistics.median(b), 3) for b in zip(*(w["busy"] for w in waves))
                ],
            }
    gain = _gain(configs, "two_stages")
    gain_lan = _gain(configs, "two_stages_lan")
    seed = seed_check()
    result = {
        "bench": "scale",
        "model": "SmolLM2-135M-Instruct.Q4_1, no flags (--speculative off)",
        "tokens": tokens,
        "repeats": repeats,
        "clients": sorted({int(n) for c in configs.values() for n in c}),
        "lan_link": f"{LAN_DELAY_MS} ms one-way, 1gbit"
        if not lan_reason
        else f"not measured: {lan_reason}",
        "calibration": {name: c.as_json() for name, c in calibrations.items()},
        "configs": configs,
        "pipeline_gain_64": gain,
        "pipeline_gain_lan_64": gain_lan,
        "pipeline_gain_bound_64": _gain_bound(calibrations.get("one_node")),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "seed_check": seed,
        "seed_check_tok_s": [round(seed["predicted"][f"split_tok_s_{ms}ms"], 2) for ms in (4, 20)],
        "logs": str(logs),
    }
    result["targets_met"] = _targets(result)
    return result


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _gain(configs: dict[str, Any], name: str) -> float | None:
    if name not in configs or "64" not in configs[name] or "64" not in configs.get("one_node", {}):
        return None
    return round(
        configs[name]["64"]["measured_tok_s"] / configs["one_node"]["64"]["measured_tok_s"], 3
    )


def _gain_bound(one_node: Calibration | None) -> float | None:
    """Two stages' gain over one node at 64 clients were the layers split evenly and nothing but
    the rows of a step to change: each stage steps micro-batches of 32 rows over half the work,
    where one node steps 64 rows over all of it (one node's probes: its step at 64 rows over its
    step at 32)."""
    if one_node is None:
        return None
    stage = one_node.route().stages[0]
    return round(stage.step_s(64) / stage.step_s(32), 3)


def _targets(result: dict[str, Any]) -> dict[str, bool | None]:
    seed = result["seed_check"]
    return {
        "ratios_within_15pct": TARGETS["ratio_low"] <= result["ratio_min"]
        and result["ratio_max"] <= TARGETS["ratio_high"],
        "pipeline_gain_64": None
        if result["pipeline_gain_64"] is None
        else result["pipeline_gain_64"] >= TARGETS["pipeline_gain_64"],
        "pipeline_gain_lan_64": None
        if result["pipeline_gain_lan_64"] is None
        else result["pipeline_gain_lan_64"] >= TARGETS["pipeline_gain_lan_64"],
        "seed_check_within_25pct": all(
            seed["within_tolerance"][f"split_tok_s_{ms}ms"] for ms in (4, 20)
        ),
    }
