"""`bench scale`'s probes, taken before the load, and the simulator's predictions from them.

A serving mesh reports in ``/api/status`` each stage's step probe (``step_probe_ms``) and each
link's round trip and bandwidth; the front (the coordinator's API and the load generator, both
on core 0, beside whichever stage the plan put there: ``front_node``) is probed here: their
CPU seconds over a warm-up wave, per streamed token.
Nothing here reads a measured wave's tokens per second.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from seamline.mesh.plan.types import LinkCost
from seamline.sim.costs import DeviceSpeed, FrontCost, Load, StageCost
from seamline.sim.prediction import GATES_PER_LAYER
from seamline_bench.servers import Server
from seamline_bench.throughput import prompts_file, wave

# (clients, tokens, prompts' seed): the first two alike but for the tokens streamed; the first and
# the third differ in their clients (the load generator's start, the same in each, cancels), and
# the third's one stream gives the stages steps of one row to time (``step_overhead_ms``)
WARM_WAVES = ((16, 4, 9000), (16, 68, 9001), (1, 16, 9002))
FRAME_DTYPE_BYTES = 4  # hidden-state frames travel as float32


@dataclass(frozen=True)
class StageProbe:
    node_id: str
    layers: tuple[int, int]
    weight_bytes: int
    step_ms: dict[int, float]  # rows -> ms of one step
    prompt_ms: dict[int, float]  # rows -> ms of one prompt chunk that long
    ranks: int = 1  # a lockstep group: its members, each reading ``weight_bytes``
    gate_link_ms_mb_s: tuple[float, float] | None = None  # the group's pair: (round trip ms, MB/s)
    # rows -> a decode step's ms outside its forward, as the stage measured it serving
    overhead_ms: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Calibration:
    stages: tuple[StageProbe, ...]
    links_ms_mb_s: tuple[
        tuple[float, float], ...
    ]  # each hop, then the return hop: (round trip ms, MB/s)
    front: FrontCost
    hidden_size: int
    # one hop's one-way ms on the data path, as one stream met it in the warm-up (None: not met)
    hop_ms: float | None = None
    # the stage (its ``node_id``) whose core also runs the front (None: stage 0's)
    front_node: str | None = None

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["front"] = {
            "ms_per_token": round(self.front.s_per_token * 1e3, 4),
            "ms_per_request": round(self.front.s_per_request * 1e3, 3),
        }
        return data

    def route(self) -> Any:
        from seamline.sim.simulate import Pipeline

        stages = []
        for i, probe in enumerate(self.stages):
            read = float(probe.weight_bytes)
            speed = DeviceSpeed(
                read / (probe.step_ms[1] / 1e3),
                {rows: rows * read / (ms / 1e3) for rows, ms in probe.step_ms.items() if rows > 1},
                {rows: rows * read / (ms / 1e3) for rows, ms in probe.prompt_ms.items()},
            )
            last = i == len(self.stages) - 1
            gate = probe.gate_link_ms_mb_s
            stages.append(
                StageCost(
                    probe.node_id,
                    speed,
                    read,
                    frame_bytes_per_row=0 if last else self.hidden_size * FRAME_DTYPE_BYTES,
                    ranks=probe.ranks,
                    gates=GATES_PER_LAYER * (probe.layers[1] - probe.layers[0]) if gate else 0,
                    gate_bytes_per_row=self.hidden_size * FRAME_DTYPE_BYTES,
                    gate_link=LinkCost(gate[0] / 2e3, max(gate[1], 0.1) * 1e6) if gate else None,
                    step_overhead_s={rows: ms / 1e3 for rows, ms in probe.overhead_ms.items()},
                )
            )
        links = tuple(LinkCost(rtt / 2e3, max(mb_s, 0.1) * 1e6) for rtt, mb_s in self.links_ms_mb_s)
        return Pipeline(tuple(stages), links)


def calibrate(server: Server, logs: Path, rank_probe: StageProbe | None = None) -> Calibration:
    """The mesh's probes (its status after a warm-up wave) and the front's CPU per token. A
    lockstep group's ranks cannot step alone: ``rank_probe`` (a node of the same kind, probed on
    its stage) gives their rate reading weights, each over its own share of the bytes."""
    front = _front_cost(server, logs)
    status = status_of(server)
    stages = tuple(_stage_probe(s, status, rank_probe) for s in status["stages"])
    links, hop = _links(status, [s.node_id for s in stages]), data_path_hop_ms(status)
    if hop is not None:  # the pings' round trip, or the data path's where it is slower
        links = tuple((max(rtt, 2 * hop), mb_s) for rtt, mb_s in links)
    beside_front = node_beside_front(server, [s.node_id for s in stages])
    return Calibration(stages, links, front, _hidden_size(), hop, beside_front)


def node_beside_front(server: Server, node_ids: list[str]) -> str | None:
    """The stage whose node is pinned to a core the load generator (and the coordinator beside
    it) runs on: a plan may put any node first, and the front's work lands on that core. None
    (stage 0's) where no node shares one or their cores cannot be read."""
    front = {int(core) for core in server.client_cores.split(",")}
    cores: dict[str, set[int]] = {}
    for proc in server.procs[1:]:  # the coordinator first, then its nodes
        try:
            node = psutil.Process(proc.pid)
            args = node.cmdline()
            cores[args[args.index("--node-id") + 1]] = set(node.cpu_affinity() or [])
        except (psutil.Error, ValueError, IndexError):
            continue
    for node_id in node_ids:
        if cores.get(node_id.split("+")[0], set()) & front:  # a lockstep group: its leader's
            return node_id
    return None


def data_path_hop_ms(status: dict[str, Any]) -> float | None:
    """One hop's one-way ms as one stream's rows met it (stage 0's ``ring_ms``: its row out to
    its token back, less each later stage's ``cycle_ms``, over the ring's hops: one a stage);
    the pings that measure a link cross it idle, a row also wakes the next stage's reader and
    is decoded there. None where no stream ran alone."""
    stages = status["stages"]
    if (
        len(stages) < 2
        or not stages[0].get("ring_ms")
        or not all(s.get("cycle_ms") for s in stages[1:])
    ):
        return None
    return max(0.0, (stages[0]["ring_ms"] - sum(s["cycle_ms"] for s in stages[1:])) / len(stages))


def _stage_probe(
    stage: dict[str, Any], status: dict[str, Any], rank_probe: StageProbe | None
) -> StageProbe:
    """A stage's probes as it reports them; a lockstep group's are its leader's steps run through
    the whole group, its gates included (``ranks`` says so, with no gate to add)."""
    layers, read = (int(stage["layers"][0]), int(stage["layers"][1])), int(stage["weight_bytes"])
    ranks = list(stage.get("ranks") or [stage["node_id"]])
    overhead = {int(rows): float(ms) for rows, ms in stage.get("step_overhead_ms", {}).items()}
    if stage.get("step_probe_ms"):
        steps = {int(r): float(ms) for r, ms in stage["step_probe_ms"].items()}
        prompts = {int(r): float(ms) for r, ms in stage.get("prompt_probe_ms", {}).items() if ms}
        return StageProbe(
            "+".join(ranks), layers, read, steps, prompts, len(ranks), overhead_ms=overhead
        )
    if len(ranks) == 1 or rank_probe is None:
        raise ValueError(
            f"stage {stage['node_id']} reported no speed probe, and no probed node of its kind stands in"
        )
    scale = _rank_share(
        layers, len(ranks)
    )  # the same bytes per second over the rank's share of the reads
    return StageProbe(
        "+".join(ranks),
        layers,
        read,
        {r: ms * scale for r, ms in rank_probe.step_ms.items()},
        {r: ms * scale for r, ms in rank_probe.prompt_ms.items()},
        len(ranks),
        _hop(status, ranks[0], ranks[1]),
        overhead,
    )


def predict(
    calibration: Calibration, clients: int, tokens: int, prompt_lengths: tuple[int, ...]
) -> dict[str, Any]:
    from seamline.runtime.pipeline_head import MAX_STEP_TOKENS, pipeline_prefill_chunk
    from seamline.sim.simulate import simulate

    load = Load(clients, round(sum(prompt_lengths) / len(prompt_lengths)), tokens)
    chunk = (
        pipeline_prefill_chunk(len(calibration.stages)) or MAX_STEP_TOKENS
    )  # as the mesh's stage 0 chunks
    done = simulate(
        calibration.route(),
        load,
        front=calibration.front,
        prompt_lengths=prompt_lengths,
        max_step_tokens=MAX_STEP_TOKENS,
        prefill_chunk=chunk,
        front_device=calibration.front_node,
    )
    return {
        "tok_s": done.tok_s,
        "ttft_s": done.p50_ttft_s(),
        "itl_ms": done.p50_ms_between_tokens(),
        "busy": list(done.busy),
    }


def _front_cost(server: Server, logs: Path) -> FrontCost:
    """CPU seconds of the coordinator and the load generator per request and per streamed token,
    from warm-up waves (``WARM_WAVES``) that differ in their tokens or in their clients alone."""
    (short, clients), (long, _), (few, few_clients) = (
        (_front_cpu_s(server, logs, *w), w[0]) for w in WARM_WAVES
    )
    per_token = max(0.0, (long[0] - short[0]) / max(1, long[1] - short[1]))
    per_request = max(
        0.0, (short[0] - few[0] - per_token * (short[1] - few[1])) / (clients - few_clients)
    )
    return FrontCost(per_token, per_request)


def _front_cpu_s(
    server: Server, logs: Path, clients: int, tokens: int, seed: int
) -> tuple[float, int]:
    """The front's CPU seconds over one warm-up wave, and the tokens it streamed."""
    coordinator = server.procs[0].pid
    before_coordinator, before_clients = _cpu_s(coordinator), _children_cpu_s()
    done = wave(server, prompts_file(clients, seed, logs), tokens)
    return (_cpu_s(coordinator) - before_coordinator) + (_children_cpu_s() - before_clients), int(
        done["tokens"]
    )


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _children_cpu_s() -> float:
    """This process's waited children's CPU seconds (the load generators, once each wave ends)."""
    times = psutil.Process().cpu_times()
    return times.children_user + times.children_system


def status_of(server: Server) -> dict[str, Any]:
    """The coordinator's /api/status, read from the namespace its clients use."""
    import json

    url = server.url.removesuffix("/v1") + "/api/status"
    code = "import httpx,sys; print(httpx.get(sys.argv[1], timeout=10).text)"
    out = subprocess.run(
        [*server.client_prefix, sys.executable, "-c", code, url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return dict(json.loads(out.stdout))


def _links(status: dict[str, Any], route: list[str]) -> tuple[tuple[float, float], ...]:
    """Each hop's (round trip ms, MB/s) as the nodes measured the pair; a pair not measured: the
    slower of the two nodes' links to the coordinator."""
    if len(route) < 2:
        return ()
    return tuple(
        _hop(status, a.split("+")[0], b.split("+")[0]) for a, b in zip(route, route[1:] + route[:1])
    )


def _hop(status: dict[str, Any], a: str, b: str) -> tuple[float, float]:
    """(round trip ms, MB/s) between nodes ``a`` and ``b`` as they measured the pair; a pair not
    measured: the slower of the two nodes' links to the coordinator."""
    for pair in status.get("links", []):
        if set(pair["nodes"]) == {a, b}:
            return float(pair["rtt_ms"]), float(pair["bandwidth_mb_s"])
    access = {
        n["node_id"]: (float(n.get("rtt_ms") or 0.0), float(n.get("bandwidth_mb_s") or 0.0))
        for n in status.get("nodes", [])
    }
    return max(access[a][0], access[b][0]), min(access[a][1], access[b][1])


def _rank_share(layers: tuple[int, int], world: int) -> float:
    """The weight bytes one rank of a ``world``-rank group reads per token over ``layers``, as a
    share of what one node owning them reads (the planner's arithmetic: ``group_spec``)."""
    from seamline.mesh.control.plan_cli import model_spec
    from seamline.mesh.plan.groups import group_spec
    from seamline.mesh.plan.pricing import range_bytes
    from seamline.mesh.plan.types import PlanOptions

    spec, _ = model_spec(None, FRAME_DTYPE_BYTES)
    options = PlanOptions(context_tokens=1)
    whole = range_bytes(spec, options, *layers)[2]
    return range_bytes(group_spec(spec, world, False), options, *layers)[2] / whole


def _hidden_size() -> int:
    from seamline.app import default_model_path
    from seamline.config import ModelConfig
    from seamline.weights.loader import open_source

    return ModelConfig.from_hf_dict(open_source(default_model_path()).config_dict()).hidden_size
