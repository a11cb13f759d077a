"""The simulator against cases whose timeline can be written down exactly."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("simpy")

from seamline.mesh.plan.types import LinkCost  # noqa: E402
from seamline.sim.costs import DeviceSpeed, FrontCost, Load, StageCost, frame_bytes  # noqa: E402
from seamline.sim.simulate import Pipeline, pipeline_bound_tok_s, simulate, spread_prompt_lengths  # noqa: E402

BATCHED = DeviceSpeed(bytes_per_second=1e9, batched={16: 4e9, 64: 8e9})
LINEAR = DeviceSpeed(bytes_per_second=1e9)  # a step's time grows with its rows
FREE_LINK = LinkCost(latency_s=0.0, bandwidth_bytes_per_s=math.inf)


def close(actual: float, expected: float) -> bool:
    return math.isclose(actual, expected, rel_tol=1e-9, abs_tol=0.0)


def stages(
    count: int, speed: DeviceSpeed = BATCHED, read_bytes: float = 1e8
) -> tuple[StageCost, ...]:
    return tuple(
        StageCost(f"s{i}", speed, read_bytes, frame_bytes_per_row=8192 if i < count - 1 else 0)
        for i in range(count)
    )


def test_one_stage_steps_every_client_each_step() -> None:
    clients, outputs = 8, 10
    stage = stages(1)[0]
    result = simulate(Pipeline(stages=(stage,), links=()), Load(clients, 1, outputs))
    a = stage.step_s(clients)
    assert close(result.wall_s, outputs * a)  # the 1-token prompts' step draws the first token
    assert close(result.tok_s, clients / a)
    assert result.steps == outputs
    assert all(close(gap, a) for gap in result.itl_s) and len(result.itl_s) == clients * (
        outputs - 1
    )
    assert all(close(t, a) for t in result.ttft_s)
    assert close(pipeline_bound_tok_s(Pipeline((stage,), ()), clients), clients / a)


def test_equal_stages_with_free_links_fill_then_cycle_micro_batches() -> None:
    """The 1-token prompts go through as one frame of C rows (S steps of C rows); then M = S
    micro-batches of k rows chase each other: micro-batch 1 comes back just as stage 0 ends
    micro-batch S, so a cycle is S steps of k rows and the last micro-batch ends (S - 1) steps
    after the first."""
    count, k, outputs = 3, 4, 6
    clients = count * k
    route = Pipeline(stages(count), (FREE_LINK,) * count)
    result = simulate(route, Load(clients, 1, outputs))
    a, b = route.stages[0].step_s(clients), route.stages[0].step_s(k)
    wall = count * a + (outputs - 1) * count * b + (count - 1) * b
    assert close(result.wall_s, wall)
    assert close(result.tok_s, clients * outputs / wall)
    assert result.steps == 1 + (outputs - 1) * count
    assert close(result.p50_ms_between_tokens(), count * b * 1000)
    assert close(
        pipeline_bound_tok_s(route, k), k / b
    )  # S micro-batches of k rows per S steps of k rows
    assert all(close(share, (a + (outputs - 1) * count * b) / wall) for share in result.busy)


def test_slow_link_sets_the_pace() -> None:
    """Steps take no time and tokens come back at once: the forward link serializes one frame of
    C rows, then micro-batch frames of k rows back to back, 2 per token per client."""
    k, outputs = 4, 5
    clients = 2 * k
    free = (StageCost("s0", BATCHED, 0.0, frame_bytes_per_row=4096), StageCost("s1", BATCHED, 0.0))
    bandwidth = 1e6
    route = Pipeline(free, (LinkCost(0.0, bandwidth), FREE_LINK))
    result = simulate(route, Load(clients, 1, outputs))
    first, each = frame_bytes(clients, 4096) / bandwidth, frame_bytes(k, 4096) / bandwidth
    wall = first + 2 * (outputs - 1) * each
    assert close(result.wall_s, wall)
    assert close(result.tok_s, clients * outputs / wall)
    assert close(pipeline_bound_tok_s(route, k), k / each)  # the link's rows per second
    assert close(result.p50_ms_between_tokens(), 2 * each * 1000)


def test_a_failed_stage_replays_every_unfinished_request() -> None:
    clients, outputs = 6, 40
    load = Load(clients, 16, outputs)
    route = Pipeline(stages(3), (FREE_LINK,) * 3)
    whole = simulate(route, load)
    at = whole.wall_s / 2
    dying = (
        route.stages[0],
        StageCost("s1", BATCHED, 1e8, frame_bytes_per_row=8192, fails_at_s=at),
        route.stages[2],
    )
    after = Pipeline(
        (
            StageCost("s0", BATCHED, 1.5e8, frame_bytes_per_row=8192),
            StageCost("s2", BATCHED, 1.5e8),
        ),
        (FREE_LINK, FREE_LINK),
    )
    result = simulate(Pipeline(dying, route.links), load, after_failure=after, replan_s=0.5)
    assert result.replayed == clients
    assert len(result.ttft_s) == clients and len(result.itl_s) == clients * (outputs - 1)
    assert close(result.tok_s * result.wall_s, clients * outputs)
    assert result.wall_s > whole.wall_s and result.wall_s > at + 0.5
    assert max(result.itl_s) >= 0.5  # the gap across the replan
    with pytest.raises(ValueError, match="after_failure"):
        simulate(Pipeline(dying, route.links), load)


def test_a_failure_after_the_wave_changes_nothing() -> None:
    load = Load(4, 8, 5)
    route = Pipeline(stages(2), (FREE_LINK,) * 2)
    whole = simulate(route, load)
    late = (route.stages[0], StageCost("s1", BATCHED, 1e8, fails_at_s=whole.wall_s * 2))
    after = Pipeline((StageCost("s0", BATCHED, 2e8),), ())
    result = simulate(Pipeline(late, route.links), load, after_failure=after)
    assert result == whole


def test_prompt_chunks_pipeline_through_the_stages() -> None:
    """Zero-cost links, one client: a whole prompt runs on stage 0 then stage 1 (2 steps of P
    rows); in chunks of P/4 stage 1 runs chunk i while stage 0 runs chunk i + 1, and the first
    token comes after the last chunk's step on stage 1: 5 steps of P/4 rows."""
    prompt = 256
    route = Pipeline(stages(2, LINEAR), (FREE_LINK,) * 2)
    chunk_s = route.stages[0].step_s(prompt // 4)
    whole = simulate(route, Load(1, prompt, 2), prefill_chunk=prompt)
    chunked = simulate(route, Load(1, prompt, 2), prefill_chunk=prompt // 4)
    assert close(whole.ttft_s[0], 2 * route.stages[0].step_s(prompt))
    assert close(chunked.ttft_s[0], 5 * chunk_s)
    assert chunked.ttft_s[0] < whole.ttft_s[0]
    assert chunked.steps == 4 + 1


def test_front_work_shares_stage_zero() -> None:
    """One stage: each request's front work before its prompt, each token's before the next step."""
    clients, outputs = 3, 4
    stage = stages(1)[0]
    front = FrontCost(s_per_token=0.002, s_per_request=0.01)
    result = simulate(Pipeline((stage,), ()), Load(clients, 1, outputs), front=front)
    a = stage.step_s(clients)
    assert close(result.wall_s, clients * 0.01 + outputs * (a + clients * 0.002))
    assert close(result.ttft_s[0], clients * 0.01 + a + 0.002)
    assert close(result.busy[0], 1.0)


def test_busy_shares_show_the_bottleneck() -> None:
    slow = StageCost("s1", BATCHED, 2e8, frame_bytes_per_row=8192)
    route = Pipeline((stages(3)[0], slow, stages(3)[2]), (LinkCost(0.0005, 125e6),) * 3)
    result = simulate(route, Load(6, 32, 20), prompt_lengths=spread_prompt_lengths(6, 8, 64))
    assert all(0.0 <= share <= 1.0 for share in result.busy)
    assert max(range(3), key=lambda i: result.busy[i]) == 1


def test_spread_prompt_lengths_match_the_bench() -> None:
    assert spread_prompt_lengths(4) == (32, 106, 181, 256)
    assert spread_prompt_lengths(1) == (32,)


def test_front_work_goes_to_the_stage_whose_core_it_shares() -> None:
    """One stream on two equal stages (step a) and free links, front work f < a per token: on
    stage 0's device it delays the next step (2a + f between tokens); on stage 1's it runs while
    stage 0 steps (2a), and that device's busy share counts it."""
    outputs, f = 6, 0.002
    route = Pipeline(stages(2, LINEAR), (FREE_LINK,) * 2)
    a = route.stages[0].step_s(1)
    assert f < a
    front = FrontCost(s_per_token=f)
    first = simulate(route, Load(1, 1, outputs), front=front)
    beside_last = simulate(route, Load(1, 1, outputs), front=front, front_device="s1")
    assert all(close(gap, 2 * a + f) for gap in first.itl_s)
    assert all(close(gap, 2 * a) for gap in beside_last.itl_s)
    assert beside_last.busy[1] > beside_last.busy[0] and first.busy[0] > first.busy[1]
    assert simulate(route, Load(1, 1, outputs), front=front, front_device="s0") == first
    with pytest.raises(ValueError, match="front_device 'elsewhere'"):
        simulate(route, Load(1, 1, outputs), front=front, front_device="elsewhere")


def test_front_work_moves_to_stage_zero_when_its_stage_fails() -> None:
    """The front's stage dies before any token: every token's front work then falls on stage 0
    of the route left, as if the front had been named there from the start."""
    load, front = Load(4, 8, 30), FrontCost(s_per_token=0.001, s_per_request=0.002)
    route = Pipeline(stages(2), (FREE_LINK,) * 2)
    dying = Pipeline((route.stages[0], StageCost("s1", BATCHED, 1e8, fails_at_s=1e-6)), route.links)
    after = Pipeline((StageCost("s0", BATCHED, 2e8),), ())
    named = simulate(dying, load, front=front, front_device="s1", after_failure=after)
    first = simulate(dying, load, front=front, after_failure=after)
    assert close(named.tok_s * named.wall_s, 4 * 30)
    assert (
        named.wall_s > simulate(dying, load, after_failure=after).wall_s
    )  # the front's work counted
    assert named.itl_s == first.itl_s and close(named.wall_s, first.wall_s)


@pytest.mark.parametrize("clients", [16, 64])
def test_a_slower_last_stage_keeps_the_decode_rows_in_m_frames(clients: int) -> None:
    """Stage 1 reading 1.3x and 1.6x stage 0's bytes: stage 0 has time to spare, yet sends no
    more frames than with equal stages (rows back early wait for the next frame: a frame's rows
    come back together, so a small frame would stay small); its decode steps are the rows over
    M frames of ceil(C / M), and the prompts' steps their tokens over 512."""
    outputs = 32
    lengths = spread_prompt_lengths(clients)
    load = Load(clients, round(sum(lengths) / clients), outputs)
    counted = []
    for last_bytes in (1e8, 1.3e8, 1.6e8):
        route = Pipeline(
            (
                StageCost("s0", BATCHED, 1e8, frame_bytes_per_row=8192),
                StageCost("s1", BATCHED, last_bytes),
            ),
            (FREE_LINK, FREE_LINK),
        )
        counted.append(simulate(route, load, prompt_lengths=lengths, prefill_chunk=128).steps)
    decode_steps = math.ceil(clients * (outputs - 1) / math.ceil(clients / 2))
    prompt_steps = math.ceil(sum(lengths) / 512)
    assert counted[0] <= decode_steps + prompt_steps + 2, counted
    assert max(counted) - min(counted) <= 1, counted
