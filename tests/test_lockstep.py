"""Lockstep group in real processes: leader here, the other ranks as subprocesses.

A split group must give Engine's greedy tokens and logits (within 1e-4) over both transports
(our TcpComm, and torch.distributed's gloo), refuse at HELLO a rank that loaded another
checkpoint, another layer range or another world — naming the mismatch — and turn a killed
rank into a CommError naming it. Real-model and other-family groups: test_lockstep_models.py.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from seamline.net.link import free_port
from seamline.parallel.comm import CommError, Transport
from seamline.parallel.lockstep import LockstepRank
from seamline.runtime.engine import Engine
from seamline.runtime.sampling import SamplingParams
from seamline.weights.loader import load_stage, open_source
from tests.lockstep_harness import (
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


def test_other_checkpoint_refused_at_hello(tmp_path: Path) -> None:
    ours = save_mixtral(tmp_path / "m")
    theirs = save_mixtral(tmp_path / "other" / "m", seed=1)  # same name and config, other weights
    with pytest.raises(CommError, match="group fingerprint mismatch"):
        start_group(ours, 2, worker_model=theirs)


def test_other_layer_range_refused_at_hello(tmp_path: Path) -> None:
    model = save_mixtral(tmp_path / "m")  # 2 layers: the leader owns [0, 2), rank 1 only [0, 1)
    ports = [free_port() for _ in range(2)]
    procs = spawn([rank_argv(model, 1, 2, ports, layers="0:1")], threads=1)
    try:
        with pytest.raises(CommError) as info:
            LockstepRank(model, 0, 2, loopback(ports))
    finally:
        (rc, err), = reap(procs)
    message = str(info.value)
    assert message.startswith("group fingerprint mismatch"), message
    assert re.search(r"rank 0 has '[^']*\|layers:0-2\|", message), message
    assert re.search(r"rank 1 has '[^']*\|layers:0-1\|", message), message
    assert rc == 1 and "group fingerprint mismatch" in err, err  # refused on its side too


def test_other_world_refused_at_hello(tmp_path: Path) -> None:
    model = save_mixtral(tmp_path / "m")  # 4 experts: worlds 2 and 4 both load
    ports = [free_port() for _ in range(4)]
    procs = spawn([rank_argv(model, 1, 2, ports[:2])], threads=1)  # rank 1 of 2, not of 4
    try:
        with pytest.raises(CommError) as info:
            LockstepRank(model, 0, 4, loopback(ports))  # dials rank 1 first
    finally:
        (rc, err), = reap(procs)
    assert str(info.value) == "world mismatch: rank 0 has world 4, rank 1 has 2"
    assert rc == 1 and "world mismatch: rank 1 has world 2, rank 0 has 4" in err, err


def test_killed_rank_raises_comm_error(tmp_path: Path) -> None:
    model = save_mixtral(tmp_path / "m")
    group, procs = start_group(model, 2, timeout_s=5.0)
    try:
        tokens = group.generate([1, 2, 3], SamplingParams(max_tokens=STEPS))
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
