"""A discrete-event simulation (SimPy) of a pipeline serving a wave of clients, as stage 0's
scheduler drives it (``runtime/pipeline_head.py``, ``runtime/scheduler.py``).

Stage 0 plans each step over the sequences that are ready (no token being drawn downstream):
the decode row of each, at most ceil(running / M) of them with M micro-batches, then prompt
chunks first come first served, at most ``prefill_chunk`` tokens per sequence and
``max_step_tokens`` rows in all. A chunk short of its prompt's end leaves its sequence ready (the
next chunk may follow at once); the prompt's last chunk and every decode row draw a token, which
puts the sequence in flight until the last stage's token comes back over the return hop.
While M frames that draw are in flight and nothing but decode rows is ready, stage 0 waits for
one to come back (the rows that came back early join it, rather than leave as a small frame of
their own that would stay one: a frame's rows return together).

Each stage's device is a SimPy resource (stages with one name share one device: a node serving
two stages); each hop is a resource for the transmission (bytes / bandwidth, one direction),
then its one-way latency runs in parallel for every frame. The front (API, coordinator,
clients: ``FrontCost``) works on stage 0's device, or on the one ``front_device`` names (the
stage whose core it shares): per request before the request reaches the scheduler, per token
before the client sees it. A stage with ``fails_at_s`` dies then: frames
in flight are lost, and after ``replan_s`` the pipeline goes on over ``after_failure``, every
unfinished sequence recomputing its prompt and the tokens it drew but the last (no draw: that
token is known), then decoding on. Deterministic: no randomness anywhere.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import simpy

from seamline.mesh.plan.types import LinkCost
from seamline.sim.costs import FrontCost, Load, StageCost, frame_bytes, return_bytes

_Process = Generator[simpy.Event, Any, None]


@dataclass(frozen=True)
class Pipeline:
    """A pipeline: its stages in order and the hops between them."""

    stages: tuple[StageCost, ...]
    links: tuple[
        LinkCost, ...
    ]  # the forward hops, then the return hop: len(stages) of them (none for one stage)
    micro_batches: int = 0  # 0: one per stage

    def batches(self) -> int:
        """Micro-batches in flight at once: each step takes at most 1/M of the running decode rows."""
        return self.micro_batches or len(self.stages)

    def check(self, what: str) -> None:
        if not self.stages:
            raise ValueError(f"{what} must have at least one stage")
        hops = len(self.stages) if len(self.stages) > 1 else 0
        if len(self.links) != hops:
            raise ValueError(
                f"{what} has {len(self.stages)} stages and so needs {hops} links "
                f"(the forward hops, then the return hop), not {len(self.links)}"
            )
        if self.micro_batches < 0:
            raise ValueError(
                f"{what}'s micro_batches must be >= 0 (0: one per stage), not {self.micro_batches}"
            )


@dataclass(frozen=True)
class SimResult:
    tok_s: (
        float  # generated tokens / wall time of the wave (first token of the first prompt included)
    )
    wall_s: float
    ttft_s: tuple[float, ...]  # per client
    itl_s: tuple[float, ...]  # every inter-token gap of every client
    busy: tuple[
        float, ...
    ]  # per stage of the route: fraction of the wall its device was busy (front work included)
    steps: int  # steps stage 0 ran
    replayed: int  # sequences replayed after a failure

    def p50_ms_between_tokens(self) -> float:
        """The median gap between a client's tokens in milliseconds (nan when no client drew two)."""
        return statistics.median(self.itl_s) * 1000.0 if self.itl_s else math.nan

    def p50_ttft_s(self) -> float:
        return statistics.median(self.ttft_s) if self.ttft_s else math.nan


@dataclass(eq=False)
class _ClientRequest:
    """One client's request as stage 0's scheduler sees it."""

    prompt: int
    outputs: int
    admitted: bool = False
    prefill_end: int = 0  # positions to compute before decoding
    cached: int = 0  # positions computed (or on their way through the stages)
    drawn: int = 0  # tokens back at stage 0
    in_flight: bool = False
    frame: int = 0  # the step whose frame carries its draw, while in flight
    prefill_draws: bool = (
        True  # the prefill's last chunk draws (not after a replay that drew tokens)
    )
    shown: list[float] = field(default_factory=list)  # when each token reached the client

    @property
    def finished(self) -> bool:
        return self.drawn >= self.outputs

    @property
    def prefilling(self) -> bool:
        return self.cached < self.prefill_end

    def ready(self) -> bool:
        return self.admitted and not self.in_flight and not self.finished

    def replay(self) -> None:
        """Start over on a new route: recompute the prompt and the tokens drawn but the last."""
        self.in_flight = False
        self.cached = 0
        self.prefill_end = self.prompt + max(0, self.drawn - 1)
        self.prefill_draws = self.drawn == 0


@dataclass(frozen=True)
class _Frame:
    rows: int
    drawing: tuple[_ClientRequest, ...]  # the sequences whose rows draw a token at the last stage
    prompt_rows: int = 0  # of ``rows``, prompt chunks'


@dataclass(eq=False)
class _Pipe:
    """One route's live parts; a failure kills it and everything still on it."""

    route: Pipeline
    hops: list[simpy.Resource]
    queues: list[simpy.Store]
    alive: bool = True


class _Wave:
    """The simulation's state and processes."""

    def __init__(
        self,
        env: simpy.Environment,
        sequences: list[_ClientRequest],
        front: FrontCost,
        max_step_tokens: int,
        prefill_chunk: int,
        front_device: str | None = None,
    ) -> None:
        self.env = env
        self.sequences = sequences
        self.front = front
        self.front_device = (
            front_device  # the stage whose device the front shares (None: stage 0's)
        )
        self.max_step_tokens = max_step_tokens
        self.prefill_chunk = prefill_chunk
        self.devices: dict[str, simpy.Resource] = {}
        self.worked: dict[str, list[tuple[float, float]]] = {}  # device -> (start, end) of each job
        self.pipe: _Pipe | None = None
        self.wake = env.event()
        self.done = env.event()
        self.tokens_shown = 0
        self.tokens_wanted = sum(s.outputs for s in sequences)
        self.steps = 0
        self.replayed = 0

    def install(self, route: Pipeline) -> None:
        """Start ``route``'s stages and hops and its scheduler."""
        for stage in route.stages:
            self.devices.setdefault(stage.name, simpy.Resource(self.env, capacity=1))
            self.worked.setdefault(stage.name, [])
        pipe = _Pipe(
            route,
            [simpy.Resource(self.env, capacity=1) for _ in route.links],
            [simpy.Store(self.env) for _ in route.stages],
        )
        self.pipe = pipe
        for index in range(1, len(route.stages)):
            self.env.process(self._stage(pipe, index))
        self.env.process(self._head(pipe))

    def arrive(self) -> None:
        """The wave: every client sends its request at t=0."""
        for sequence in self.sequences:
            if self.front.s_per_request > 0:
                self._front(self.front.s_per_request, partial(self._admit, sequence))
            else:
                self._admit(sequence)

    def fail(self, at_s: float, after: Pipeline, replan_s: float) -> _Process:
        """At ``at_s`` a stage dies; after ``replan_s`` every unfinished sequence replays on ``after``."""
        yield self.env.timeout(at_s)
        if self.done.triggered:
            return
        assert self.pipe is not None
        self.pipe.alive = False
        for sequence in self.sequences:
            if sequence.finished:
                continue
            self.replayed += bool(sequence.cached or sequence.drawn)
            sequence.replay()
        yield self.env.timeout(replan_s)
        self.install(after)

    def _admit(self, sequence: _ClientRequest) -> None:
        sequence.admitted = True
        sequence.prefill_end = sequence.prompt + max(0, sequence.drawn - 1)
        self._notify()

    def _notify(self) -> None:
        if not self.wake.triggered:
            self.wake.succeed()

    def _spend(self, device: str, seconds: float) -> simpy.Timeout:
        """A job of ``seconds`` on ``device``, which the caller holds."""
        self.worked[device].append((self.env.now, self.env.now + seconds))
        return self.env.timeout(seconds)

    def _head(self, pipe: _Pipe) -> _Process:
        """Stage 0: whenever its device is free and a sequence is ready, plan a step, run it, send it on."""
        stage = pipe.route.stages[0]
        device = self.devices[stage.name]
        while pipe.alive:
            if not any(s.ready() for s in self.sequences) or self._frames_full(pipe.route):
                self.wake = self.env.event()
                yield self.wake
                continue
            with device.request() as granted:
                yield granted
                if not pipe.alive:
                    return
                frame = self._plan(pipe.route)
                if not frame.rows:
                    continue
                self.steps += 1
                yield self._spend(stage.name, stage.step_s(frame.rows, frame.prompt_rows))
            if pipe.alive:
                self._pass_on(pipe, frame, 0)

    def _frames_full(self, route: Pipeline) -> bool:
        """M frames that draw in flight, and nothing ready but decode rows (``PipelineHead``)."""
        frames = {s.frame for s in self.sequences if s.in_flight and not s.finished}
        if len(frames) < route.batches():
            return False
        return not any(s.ready() and s.prefilling for s in self.sequences)

    def _plan(self, route: Pipeline) -> _Frame:
        """Decode rows first (one per ready sequence, at most 1/M of the running), then prompt
        chunks in arrival order, within ``max_step_tokens`` rows; the rows that draw put their
        sequence in flight."""
        running = [s for s in self.sequences if s.admitted and not s.finished]
        cap = max(1, -(-len(running) // route.batches()))
        ready = [s for s in running if s.ready()]
        drawing = [s for s in ready if not s.prefilling][: min(cap, self.max_step_tokens)]
        rows = decode = len(drawing)
        for sequence in drawing:
            sequence.cached += 1
            sequence.in_flight, sequence.frame = True, self.steps
        for sequence in ready:
            if not sequence.prefilling:
                continue
            count = min(
                sequence.prefill_end - sequence.cached,
                self.prefill_chunk,
                self.max_step_tokens - rows,
            )
            if count <= 0:
                break
            sequence.cached += count
            rows += count
            if not sequence.prefilling and sequence.prefill_draws:
                sequence.in_flight, sequence.frame = True, self.steps
                drawing.append(sequence)
        return _Frame(rows, tuple(drawing), rows - decode)

    def _stage(self, pipe: _Pipe, index: int) -> _Process:
        """A later stage: frames in arrival order, one step each, then on to the next hop."""
        stage = pipe.route.stages[index]
        device = self.devices[stage.name]
        while pipe.alive:
            frame = yield pipe.queues[index].get()
            if not pipe.alive:
                return
            with device.request() as granted:
                yield granted
                yield self._spend(stage.name, stage.step_s(frame.rows, frame.prompt_rows))
            if pipe.alive:
                self._pass_on(pipe, frame, index)

    def _pass_on(self, pipe: _Pipe, frame: _Frame, index: int) -> None:
        """After stage ``index``'s step: the frame to the next stage, or its tokens back to stage 0."""
        stages = pipe.route.stages
        if len(stages) == 1:
            self._tokens(frame)
        elif index < len(stages) - 1:
            nbytes = frame_bytes(frame.rows, stages[index].frame_bytes_per_row)
            self.env.process(self._send(pipe, frame, index, nbytes))
        elif (
            frame.drawing
        ):  # a frame of prompt chunks short of their ends draws nothing: nothing goes back
            self.env.process(self._send(pipe, frame, index, return_bytes(len(frame.drawing))))

    def _send(self, pipe: _Pipe, frame: _Frame, hop: int, nbytes: int) -> _Process:
        """Hop ``hop``: wait for the link, serialize the bytes, then its latency; the last hop returns tokens."""
        link = pipe.route.links[hop]
        with pipe.hops[hop].request() as granted:
            yield granted
            if not pipe.alive:
                return
            yield self.env.timeout(nbytes / link.bandwidth_bytes_per_s)
        yield self.env.timeout(link.latency_s)
        if not pipe.alive:
            return
        if hop == len(pipe.route.stages) - 1:
            self._tokens(frame)
        else:
            pipe.queues[hop + 1].put(frame)

    def _tokens(self, frame: _Frame) -> None:
        """Tokens back at stage 0: their sequences are ready again; the front streams each."""
        for sequence in frame.drawing:
            sequence.drawn += 1
            sequence.in_flight = False
            if self.front.s_per_token > 0:
                self._front(self.front.s_per_token, partial(self._show, sequence))
            else:
                self._show(sequence)
        self._notify()

    def _front(self, seconds: float, then: Callable[[], None]) -> None:
        """Front work on its device, queued now (before a step planned later); ``then`` once done.
        Stage 0's where ``front_device`` is not on the route (none named, or it failed)."""
        assert self.pipe is not None
        names = [stage.name for stage in self.pipe.route.stages]
        name = self.front_device if self.front_device in names else names[0]
        device = self.devices[name]
        self.env.process(self._front_job(device, device.request(), name, seconds, then))

    def _front_job(
        self,
        device: simpy.Resource,
        request: simpy.Event,
        name: str,
        seconds: float,
        then: Callable[[], None],
    ) -> _Process:
        yield request
        yield self._spend(name, seconds)
        device.release(request)
        then()

    def _show(self, sequence: _ClientRequest) -> None:
        sequence.shown.append(self.env.now)
        self.tokens_shown += 1
        if self.tokens_shown == self.tokens_wanted:
            self.done.succeed()

    def busy(self, route: Pipeline, wall_s: float) -> tuple[float, ...]:
        """Each stage's device: the share of [0, wall_s] it worked."""
        if wall_s <= 0:
            return tuple(0.0 for _ in route.stages)
        return tuple(
            min(
                1.0,
                sum(max(0.0, min(end, wall_s) - start) for start, end in self.worked[s.name])
                / wall_s,
            )
            for s in route.stages
        )


def simulate(
    route: Pipeline,
    load: Load,
    *,
    front: FrontCost = FrontCost(),
    max_step_tokens: int = 512,
    prefill_chunk: int = 512,
    after_failure: Pipeline | None = None,
    replan_s: float = 1.0,
    prompt_lengths: tuple[int, ...] | None = None,
    front_device: str | None = None,
) -> SimResult:
    """The wave ``load`` on ``route``: every client's tokens, when they reached it, and each device's busy share.

    ``prompt_lengths``: each client's prompt (instead of ``load.prompt_tokens`` for all).
    ``front_device``: the stage whose device also runs the front (None: stage 0). A stage
    of ``route`` with ``fails_at_s`` dies then (the earliest, if several) and the wave goes on
    over ``after_failure`` after ``replan_s``."""
    failure = _check(
        route,
        load,
        max_step_tokens,
        prefill_chunk,
        after_failure,
        replan_s,
        prompt_lengths,
        front_device,
    )
    prompts = prompt_lengths if prompt_lengths is not None else (load.prompt_tokens,) * load.clients
    env = simpy.Environment()
    wave = _Wave(
        env,
        [_ClientRequest(prompt, load.output_tokens) for prompt in prompts],
        front,
        max_step_tokens,
        prefill_chunk,
        front_device,
    )
    wave.install(route)
    wave.arrive()
    if failure is not None and after_failure is not None:
        env.process(wave.fail(failure, after_failure, replan_s))
    try:
        env.run(until=wave.done)
    except RuntimeError as exc:
        raise RuntimeError(
            f"the simulation stalled before every client had its tokens ({exc})"
        ) from None
    wall = env.now
    ttft = tuple(s.shown[0] for s in wave.sequences)
    gaps = tuple(
        later - earlier for s in wave.sequences for earlier, later in zip(s.shown, s.shown[1:])
    )
    total = load.clients * load.output_tokens
    return SimResult(
        tok_s=total / wall if wall > 0 else math.inf,
        wall_s=wall,
        ttft_s=ttft,
        itl_s=gaps,
        busy=wave.busy(route, wall),
        steps=wave.steps,
        replayed=wave.replayed,
    )


def _check(
    route: Pipeline,
    load: Load,
    max_step_tokens: int,
    prefill_chunk: int,
    after_failure: Pipeline | None,
    replan_s: float,
    prompt_lengths: tuple[int, ...] | None,
    front_device: str | None,
) -> float | None:
    """Validate the inputs; the time of the route's first failure, if any."""
    route.check("the route")
    if front_device is not None and front_device not in {stage.name for stage in route.stages}:
        raise ValueError(f"front_device {front_device!r} is not a stage of the route")
    if load.clients < 1 or load.output_tokens < 1:
        raise ValueError(f"a wave needs at least one client and one output token, not {load}")
    prompts = prompt_lengths if prompt_lengths is not None else (load.prompt_tokens,)
    if prompt_lengths is not None and len(prompt_lengths) != load.clients:
        raise ValueError(
            f"prompt_lengths has {len(prompt_lengths)} entries for {load.clients} clients"
        )
    if min(prompts) < 1:
        raise ValueError(f"every prompt must have at least one token, not {min(prompts)}")
    if max_step_tokens < 1 or prefill_chunk < 1:
        raise ValueError(
            f"max_step_tokens ({max_step_tokens}) and prefill_chunk ({prefill_chunk}) must be >= 1"
        )
    failing = [s for s in route.stages if s.fails_at_s is not None]
    if not failing:
        return None
    first = min(failing, key=lambda s: s.fails_at_s or 0.0)
    if after_failure is None:
        raise ValueError(
            f"stage {first.name} fails at {first.fails_at_s} s but no after_failure route "
            "says where the pipeline goes on"
        )
    after_failure.check("the after_failure route")
    if any(s.fails_at_s is not None for s in after_failure.stages):
        raise ValueError("the after_failure route cannot fail again: the simulator replans once")
    if first.name in {s.name for s in after_failure.stages}:
        raise ValueError(
            f"the after_failure route goes through {first.name}, the stage that failed"
        )
    if replan_s < 0:
        raise ValueError(f"replan_s must be >= 0, not {replan_s}")
    return first.fails_at_s


def pipeline_bound_tok_s(route: Pipeline, rows_per_micro_batch: int) -> float:
    """Steady-state decode tokens/s with M micro-batches of ``rows_per_micro_batch`` rows each:
    M x rows per cycle, a cycle as long as the larger of one micro-batch's round trip and M
    times the busiest device's or link's share of it (no front cost)."""
    rows = rows_per_micro_batch
    stages, links = route.stages, route.links
    device_s: dict[str, float] = {}
    for stage in stages:
        device_s[stage.name] = device_s.get(stage.name, 0.0) + stage.step_s(rows)
    sizes = [frame_bytes(rows, s.frame_bytes_per_row) for s in stages[:-1]] + (
        [return_bytes(rows)] if links else []
    )
    wire_s = [nbytes / link.bandwidth_bytes_per_s for nbytes, link in zip(sizes, links)]
    round_trip = sum(s.step_s(rows) for s in stages) + sum(
        link.seconds(n) for n, link in zip(sizes, links)
    )
    period = max(round_trip, route.batches() * max([*device_s.values(), *wire_s]))
    return route.batches() * rows / period if period > 0 else math.inf


def spread_prompt_lengths(clients: int, shortest: int = 32, longest: int = 256) -> tuple[int, ...]:
    """Prompt lengths spread evenly from ``shortest`` to ``longest``, as the throughput bench's prompts are."""
    return tuple(shortest + (longest - shortest) * i // max(1, clients - 1) for i in range(clients))
