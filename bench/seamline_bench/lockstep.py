"""`seamline bench lockstep`: one core against a 2-rank lockstep group of one core per rank.

Model: a random DeepSeek-V3-style MoE whose routed experts dominate its >= 1 GB of float32
weights (``moe_model``). Parties, each in its own process (``lockstep_driver``), all greedy,
float32, one torch thread:

- single: seamline's Engine on core 0 (the first core this process may use);
- lockstep2 per transport (``tcp``: TcpComm; ``torch``: gloo): the leader on core 0, rank 1
  (``python -m seamline.runtime.lockstep_group``) on core 1 (the second), each holding half the
  routed experts, heads and vocabulary.

Each run decodes ``tokens`` tokens after the same 16-token prompt; the rate is taken over the
decode steps only. Runs alternate (single, then each group, then a single engine on each core
at once) ``repeats`` times after a short warm-up; medians are reported. The side-by-side pair
shows what the two cores give together right now: a perfectly split group with free gates
would make twice the slower one's rate (``ideal_speedup_given_cores``). A group's greedy tokens must equal the single engine's
(``tokens_match``).

Bytes per token, measured: the kernel's per-socket TCP counters (``tcpi_bytes_sent`` less
``tcpi_bytes_retrans``: payload bytes put on the wire once, without TCP/IP headers; the
retransmitted bytes are reported apart), summed over every TCP socket of each rank process
across exactly the timed decode steps, divided by the tokens, averaged over the two ranks —
the same method for both transports, and no counter inside either transport. Where a fresh
network namespace can be made (root), each group runs alone in one, and the loopback
interface's ``tx_bytes`` (both ranks, headers and pure ACKs included) / 2 / tokens is
reported beside it as a cross-check.

Theory, per rank per token (world 2, the rank sends to its one peer): two gates per layer of
``hidden`` float32, the greedy (max, argmax) pair of its vocabulary slice (16 bytes; whole
logits would be vocab/2 float32), and the 64-byte command that carries the token id.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import torch

from seamline_bench.driver import Driver, median
from seamline_bench.moe_model import build_model, model_facts
from seamline_bench.v4_parting import v4_parting

PROMPT_TOKENS = 16
DRIVER = "seamline_bench.lockstep_driver"
TRANSPORTS = ("tcp", "tcp_tls", "torch")  # tcp_tls: tcp over mutual TLS, as a mesh's groups run
BYTES_METHOD = (
    "kernel per-socket TCP counters tcpi_bytes_sent - tcpi_bytes_retrans (payload bytes put on "
    "the wire once, no TCP/IP headers; read with `ss -tinp`), summed over all TCP sockets of "
    "each rank process across the timed decode steps, / tokens, mean of the 2 ranks"
)
LO_METHOD = (
    "tx_bytes of lo in a fresh network namespace holding only this group (both ranks' traffic "
    "incl. Ethernet/IP/TCP headers and pure ACKs), / 2 ranks / tokens"
)


NOTES = [
    "tok/s: decode steps only (after the prompt's prefill), one torch thread per process, float32, greedy",
    "speedup = lockstep2_tok_s / single_tok_s, medians over repeats (runs alternate single, tcp, torch)",
    "leader_comm_ms_per_token: the leader's time inside collectives = transfer + waking up + waiting for "
    "rank 1 to reach the gate (its share of the chosen experts may be larger that token)",
    "loadavg_1min: this machine may be shared; a busy core stalls the whole group at every gate",
    (
        "both_cores_single_tok_s: the single engine on each core while both run at once (each repeat); "
        "ideal_speedup_given_cores = 2 x the slower of them / single_tok_s: a group with a perfect split and "
        "free gates on these cores now; speedup_of_ideal = speedup / that"
    ),
]


def netns_available() -> bool:
    return os.geteuid() == 0


def theory_bytes(facts: dict[str, Any]) -> int:
    gates = 2 * facts["layers"] * facts["hidden"] * 4
    argmax = 2 * 8  # greedy: the shard's (max, argmax) as two float64, not its V/2 logits
    control = 64  # the command; the token id rides in it
    return gates + argmax + control


def bench_lockstep(
    repeats: int = 3,
    tokens: int = 128,
    size: str = "bench",
    transports: tuple[str, ...] = TRANSPORTS,
    netns: bool | None = None,
    v4: bool = True,
) -> dict[str, Any]:
    """The JSON of `seamline bench lockstep`. ``size``: "bench" (>= 1 GB) or "tiny" (tests);
    ``netns``: run each group in a fresh network namespace (None: when root); ``v4``: with
    the DeepSeek-V4 rows (``v4_lockstep``)."""
    if repeats < 1 or tokens < 1:
        raise ValueError("repeats and tokens must be >= 1")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise RuntimeError("bench lockstep pins its two ranks to two cores: it needs two CPUs")
    core0, core1 = cpus[0], cpus[1]
    folder = build_model(size)
    facts = model_facts(folder)
    netns = netns_available() if netns is None else netns
    gen = torch.Generator().manual_seed(1)
    prompt = ",".join(
        str(t) for t in torch.randint(0, facts["vocab"], (PROMPT_TOKENS,), generator=gen).tolist()
    )
    common = ["--model", str(folder), "--prompt", prompt]
    load_before = os.getloadavg()
    drivers: dict[str, Driver] = {}
    runs: dict[str, list[dict[str, Any]]] = {"single": [], **{t: [] for t in transports}}
    both: list[tuple[dict[str, Any], dict[str, Any]]] = []  # the two cores' singles at once
    try:
        drivers["single"] = Driver(DRIVER, ["single", *common, "--core", str(core0)])
        peer_single = drivers["single_core1"] = Driver(
            DRIVER, ["single", *common, "--core", str(core1)]
        )
        for transport in transports:
            extra = ["--netns"] if netns else []
            extra += ["--tls"] if transport == "tcp_tls" else []
            drivers[transport] = Driver(
                DRIVER,
                [
                    "group",
                    *common,
                    "--transport",
                    transport.removesuffix("_tls"),
                    "--core",
                    str(core0),
                    "--peer-core",
                    str(core1),
                    *extra,
                ],
            )
        ready = {name: d.wait_ready() for name, d in drivers.items()}
        for driver in drivers.values():  # warm-up
            driver.measure(min(8, tokens))
        for _ in range(repeats):  # alternate: the machine is shared and noisy
            for name in runs:
                runs[name].append(drivers[name].measure(tokens))
            both.append(_side_by_side(drivers["single"], peer_single, tokens))
    finally:
        for driver in drivers.values():
            driver.close()
    result = _result(runs, facts, tokens, repeats, transports, ready)
    result.update(_cores_ceiling(both, result))
    result["cores"] = {"single": core0, "lockstep2_rank0_leader": core0, "lockstep2_rank1": core1}
    # the machine may be shared: a busy core stalls the group at every gate (see the notes)
    result["loadavg_1min"] = {
        "before": round(load_before[0], 2),
        "after": round(os.getloadavg()[0], 2),
    }
    if v4:
        result.update(v4_lockstep(repeats, min(tokens, V4_TOKENS), size, core0, core1))
    return result


V4_TOKENS = 32


def v4_lockstep(repeats: int, tokens: int, size: str, core0: int, core1: int) -> dict[str, Any]:
    """A V4-shaped model (``v4_model``, bfloat16): one core against a 2-rank group of one core
    per rank (tcp), alternating; decode steps timed as above."""
    from seamline_bench.v4_model import build_v4_model

    folder = build_v4_model(size)
    ids = torch.randint(
        0, 1000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    common = ["--model", str(folder), "--prompt", ",".join(map(str, ids)), "--dtype", "bfloat16"]
    drivers = {
        "single": Driver(DRIVER, ["single", *common, "--core", str(core0)]),
        "lockstep2": Driver(
            DRIVER, ["group", *common, "--core", str(core0), "--peer-core", str(core1)]
        ),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in drivers}
    try:
        for driver in drivers.values():
            driver.wait_ready()
            driver.measure(2)  # warm-up
        for _ in range(repeats):
            for name, driver in drivers.items():
                runs[name].append(driver.measure(tokens))
    finally:
        for driver in drivers.values():
            driver.close()
    single, group = median(runs["single"], "tok_s"), median(runs["lockstep2"], "tok_s")
    first = runs["single"][0]["tokens"]
    parted = next((r["tokens"] for rs in runs.values() for r in rs if r["tokens"] != first), first)
    return v4_parting(folder, ids, first, parted, tokens, core0, core1) | {
        "v4_model": folder.name,
        "v4_single_tok_s": round(single, 2),
        "v4_lockstep2_tok_s": round(group, 2),
        "v4_lockstep_speedup": round(group / single, 3),
        "v4_tokens_match": all(
            r["tokens"] == runs["single"][0]["tokens"] for rs in runs.values() for r in rs
        ),
        "v4_split": "each rank: whole output groups of query heads (q_b rows, sinks, o_a rows, o_b columns), "
        "half the routed experts, half the shared expert's rows, half the head's rows; every rank: "
        "q_a, the shared key/value head, the compressors and the indexer (the caches), "
        "hyper-connections, norms, the router",
        "v4_runs_tok_s": {k: [round(float(r["tok_s"]), 2) for r in v] for k, v in runs.items()},
        "v4_dtype": "bfloat16",
        "v4_tokens": tokens,
    }


def _side_by_side(
    first: Driver, second: Driver, tokens: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    first.start(tokens)
    second.start(tokens)
    return first.result(), second.result()


def _cores_ceiling(
    both: list[tuple[dict[str, Any], dict[str, Any]]], result: dict[str, Any]
) -> dict[str, Any]:
    """What the two cores give when both work at once: a group that halved the work perfectly,
    with free gates, would make 2 x the slower core's rate."""
    rates = [statistics.median(float(pair[i]["tok_s"]) for pair in both) for i in (0, 1)]
    ideal = 2 * min(rates) / result["single_tok_s"]
    return {
        "both_cores_single_tok_s": [round(r, 2) for r in rates],
        "ideal_speedup_given_cores": round(ideal, 3),
        "speedup_of_ideal": round(result["speedup"] / ideal, 3),
    }


def _transport_result(
    runs: list[dict[str, Any]],
    single: list[dict[str, Any]],
    facts: dict[str, Any],
    tokens: int,
    ready: dict[str, Any],
) -> dict[str, Any]:
    single_tok_s, group_tok_s = median(single, "tok_s"), median(runs, "tok_s")
    theory = theory_bytes(facts)
    # what each rank's sockets carried once: sent less retransmitted (retransmissions apart)
    per_rank = [
        statistics.median(
            (r["tcp_bytes_sent"][i] - r["tcp_bytes_retrans"][i]) / tokens for r in runs
        )
        for i in range(2)
    ]
    measured = sum(per_rank) / 2
    retrans = statistics.median(sum(r["tcp_bytes_retrans"]) / 2 / tokens for r in runs)
    out: dict[str, Any] = {
        "single_tok_s": round(single_tok_s, 2),
        "lockstep2_tok_s": round(group_tok_s, 2),
        "speedup": round(group_tok_s / single_tok_s, 3),
        "tokens_match": all(r["tokens"] == s["tokens"] for r in runs for s in single),
        "bytes_per_token_measured": round(measured, 1),
        "bytes_per_token_measured_per_rank": [round(b, 1) for b in per_rank],
        "bytes_per_token_theory": theory,
        "bytes_ratio": round(measured / theory, 4),
        "bytes_method": BYTES_METHOD,
        "retransmitted_bytes_per_token": round(retrans, 1),
        "ms_per_token": round(median(runs, "ms_per_token"), 2),
        "single_ms_per_token": round(median(single, "ms_per_token"), 2),
        "runs_tok_s": [round(float(r["tok_s"]), 2) for r in runs],
        "netns": ready.get("netns"),
    }
    if all("comm_ms_per_token" in r for r in runs):
        comm = median(runs, "comm_ms_per_token")
        # the leader's time inside collectives: the transfer plus waiting for rank 1 to reach
        # the gate (its share of the routed experts may be larger this token)
        out["leader_comm_ms_per_token"] = round(comm, 2)
        out["leader_compute_ms_per_token"] = round(out["ms_per_token"] - comm, 2)
    if all(r.get("lo_tx_bytes") is not None for r in runs):
        lo = statistics.median(r["lo_tx_bytes"] / 2 / tokens for r in runs)
        out["lo_bytes_per_token"] = round(lo, 1)
        out["lo_bytes_ratio"] = round(lo / theory, 4)
        out["lo_bytes_method"] = LO_METHOD
    return out


def _result(
    runs: dict[str, list[dict[str, Any]]],
    facts: dict[str, Any],
    tokens: int,
    repeats: int,
    transports: tuple[str, ...],
    ready: dict[str, Any],
) -> dict[str, Any]:
    single = runs["single"]
    per_transport = {
        t: _transport_result(runs[t], single, facts, tokens, ready[t]) for t in transports
    }
    default = per_transport["tcp"] if "tcp" in per_transport else per_transport[transports[0]]
    keys = (
        "single_tok_s",
        "lockstep2_tok_s",
        "speedup",
        "tokens_match",
        "bytes_per_token_measured",
        "bytes_per_token_theory",
        "bytes_ratio",
        "bytes_method",
    )
    return {
        "bench": "lockstep",
        "default_transport": "tcp" if "tcp" in per_transport else transports[0],
        **{k: default[k] for k in keys},
        "transports": per_transport,
        # a mesh's groups run tcp over mutual TLS: its speedup beside plaintext tcp's, from the same runs
        "speedup_tls": per_transport["tcp_tls"]["speedup"] if "tcp_tls" in per_transport else None,
        "model": facts,
        "dtype": "float32",
        "threads_per_rank": 1,
        "prompt_tokens": PROMPT_TOKENS,
        "tokens": tokens,
        "repeats": repeats,
        "single_runs_tok_s": [round(float(r["tok_s"]), 2) for r in single],
        "single_tokens_stable": all(r["tokens"] == single[0]["tokens"] for r in single),
        "notes": NOTES,
    }
