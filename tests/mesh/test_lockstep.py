"""Lockstep group in real processes: leader here, the other ranks as subprocesses.

A split group must give Engine's greedy tokens and logits (within 1e-4) over both transports
(our TcpComm, and torch.distributed's gloo), refuse at HELLO a rank that loaded another
checkpoint, another layer range or another world — naming the mismatch — and turn a killed
rank into a CommError naming it. Real-model and other-family groups: test_lockstep_models.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from seamline.net.link import free_port
from seamline.parallel.comm import CommError, Transport
from seamline.params import SamplingParams
from seamline.runtime.engine import Engine
from seamline.runtime.group_stage import LockstepStage
from seamline.runtime.lockstep_group import LockstepRank
from seamline.weights.loader import load_stage, open_source
from tests.support.lockstep_harness import (
    ATOL,
    PROMPT,
    STEPS,
    check_group,
    engine_reference,
    loopback,
    rank_argv,
    reap,
    running_group,
    save_mixtral,
    spawn,
    start_group,
)


@pytest.mark.parametrize(("world", "transport"), [(2, "tcp"), (4, "tcp"), (2, "torch")])
def test_mixtral(tmp_path: Path, world: int, transport: Transport) -> None:
    model = save_mixtral(tmp_path / "m")
    ref = engine_reference(Engine(load_stage(open_source(model))), PROMPT)
    with running_group(model, world, transport) as group:
        comm = type(group.leader.comm.inner).__name__  # type: ignore[attr-defined]
        assert comm == {"tcp": "TcpComm", "torch": "TorchComm"}[transport]
        check_group(group, ref, ATOL)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy-pairs", "full-logits"])
def test_a_batch_of_sequences_is_one_mirrored_command(tmp_path: Path, greedy: bool) -> None:
    """Four sequences at different positions, decode rows and a prefill chunk mixed, as one BATCH
    command of a 2-rank group (one forward on each rank, gates carrying every row): each span's
    logits equal the single process's batched step within 1e-4, greedy pairs giving the same
    argmax; a BATCH naming a sequence at the wrong position is refused and the group goes on."""
    import torch

    from seamline.errors import RequestError
    from seamline.model.cache import Span
    from seamline.runtime.group_stage import GroupCache, LockstepStage

    model = save_mixtral(tmp_path / "m")
    single = load_stage(open_source(model))
    prompts = [PROMPT[:5], PROMPT[:8], PROMPT[:3], PROMPT[:7]]
    assert len(PROMPT) >= 8
    with running_group(model, 2) as group:
        stage = LockstepStage(group)
        caches = [stage.new_cache(greedy) for _ in prompts]
        alone = [single.new_cache() for _ in prompts]
        for prompt, cache, mine in zip(
            prompts[:3], caches, alone
        ):  # three are decoding, one arrives
            stage(torch.tensor(prompt), 0, cache, last_only=True)
            single(torch.tensor(prompt), 0, mine, last_only=True)
        rows = torch.tensor([11, 12, 13, *prompts[3]])
        spans = [
            Span(0, 1, 5, caches[0]),
            Span(1, 1, 8, caches[1]),
            Span(2, 1, 3, caches[2]),
            Span(3, len(prompts[3]), 0, caches[3]),
        ]
        got = stage.forward_batch(rows, spans, last_only=True)
        want = single.forward_batch(
            rows,
            [Span(s.offset, s.count, s.start, c) for s, c in zip(spans, alone)],
            last_only=True,
        )
        assert got.shape == want.shape == (4, single.config.vocab_size)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        if not greedy:
            assert (got - want).abs().max().item() <= ATOL
        stale = [Span(0, 1, 5, caches[0]), Span(1, 1, 9, caches[1])]  # caches[0] is at 6 now
        with pytest.raises(RequestError, match="is at position 6"):
            stage.forward_batch(torch.tensor([1, 2]), stale, last_only=True)
        again = stage.forward_batch(
            torch.tensor([21, 22]),
            [Span(0, 1, 6, caches[0]), Span(1, 1, 9, caches[1])],
            last_only=True,
        )
        assert again.shape == (2, single.config.vocab_size)
        for cache in caches:
            stage.release_cache(cache)
        assert isinstance(caches[0], GroupCache)


def test_other_checkpoint_refused_at_hello(tmp_path: Path) -> None:
    ours = save_mixtral(tmp_path / "m")
    theirs = save_mixtral(tmp_path / "other" / "m", seed=1)  # same name and config, other weights
    with pytest.raises(
        CommError,
        match=r"group mismatch: rank 0 has weights:[0-9a-f]+ here, "
        r"weights:[0-9a-f]+ on rank 1$",
    ):
        start_group(ours, 2, worker_model=theirs)


def test_other_layer_range_refused_at_hello(tmp_path: Path) -> None:
    model = save_mixtral(tmp_path / "m")  # 2 layers: the leader owns [0, 2), rank 1 only [0, 1)
    ports = [free_port() for _ in range(2)]
    procs = spawn([rank_argv(model, 1, 2, ports, layers="0:1")], threads=1)
    try:
        with pytest.raises(CommError) as info:
            LockstepRank(model, 0, 2, loopback(ports))
    finally:
        ((rc, err),) = reap(procs)
    message = str(info.value)
    assert message.startswith("group mismatch: rank 0 has "), message
    assert "layers:0-2 here, layers:0-1 on rank 1" in message, message
    assert "gates:2x2 here, gates:2x1 on rank 1" in message, message
    assert rc == 1 and "layers:0-1 here, layers:0-2 on rank 0" in err, (
        err
    )  # refused on its side too


@pytest.mark.parametrize(("leader_world", "worker_world"), [(4, 2), (2, 4)])
def test_other_world_refused_at_hello(tmp_path: Path, leader_world: int, worker_world: int) -> None:
    """Named at once either way: rank 1 takes rank 0's HELLO before dialing higher ranks."""
    model = save_mixtral(tmp_path / "m")  # 4 experts: worlds 2 and 4 both load
    ports = [free_port() for _ in range(4)]
    procs = spawn(
        [rank_argv(model, 1, worker_world, ports[:worker_world], timeout_s=20.0)], threads=1
    )
    started = time.monotonic()
    try:
        with pytest.raises(CommError) as info:
            LockstepRank(model, 0, leader_world, loopback(ports[:leader_world]), 20.0)
    finally:
        ((rc, err),) = reap(procs)
    assert (
        str(info.value)
        == f"world mismatch: rank 0 has world {leader_world}, rank 1 has {worker_world}"
    )
    assert (
        rc == 1
        and f"world mismatch: rank 1 has world {worker_world}, rank 0 has {leader_world}" in err
    ), err
    assert time.monotonic() - started < 20.0  # no gate or connect timeout was waited out


def test_killed_rank_raises_comm_error(tmp_path: Path) -> None:
    model = save_mixtral(tmp_path / "m")
    group, procs = start_group(model, 2, timeout_s=5.0)
    try:
        tokens = Engine(LockstepStage(group)).generate([1, 2, 3], SamplingParams(max_tokens=STEPS))
        next(tokens), next(tokens)
        procs[0].kill()
        procs[0].wait()
        started = time.monotonic()
        with pytest.raises(CommError, match="rank 1"):
            list(tokens)
        assert time.monotonic() - started < 5.0 + 2.0
    finally:
        group.close()
        reap(procs)
