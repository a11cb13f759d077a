"""Lockstep groups in real processes for tests: the leader (rank 0) in the test process, the
other ranks as ``python -m seamline.runtime.lockstep_group`` subprocesses over loopback sockets.

``engine_reference`` runs the single-process ``Engine.generate`` once, recording the logits of
each forward; ``check_group`` holds a group to it: ``LockstepGroup.generate`` must give the
same greedy tokens, from logits within ``atol`` at every step (prefill and each decode).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from seamline.net.link import free_port
from seamline.parallel.comm import Transport
from seamline.params import SamplingParams
from seamline.runtime.engine import PREFILL_CHUNK, Engine
from seamline.runtime.group_stage import LockstepStage
from seamline.runtime.lockstep_group import DECODE, PREFILL, LockstepRank
from seamline.runtime.lockstep_leader import LockstepGroup
from seamline.weights.loader import DTYPES

STEPS = 64
ATOL = 1e-4  # random checkpoints (small activations), fp32
ROOT = Path(__file__).resolve().parents[2]  # the repository
MIXTRAL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    num_local_experts=4,
    num_experts_per_tok=2,
)
PROMPT = [1, 5, 9, 13, 2, 7, 3, 11]  # for random checkpoints


def save_mixtral(folder: Path, seed: int = 0) -> Path:
    from transformers import MixtralConfig

    from tests.support.reference import save_random_model

    save_random_model(MixtralConfig(**MIXTRAL), folder, seed=seed)
    return folder


def threads_for(world: int) -> int:
    return max(1, (os.cpu_count() or 2) // world)  # ranks share the CPUs: no oversubscription


def loopback(ports: list[int]) -> list[tuple[str, int]]:
    return [("127.0.0.1", p) for p in ports]


def rank_argv(
    model: Path,
    rank: int,
    world: int,
    ports: list[int],
    timeout_s: float = 30.0,
    transport: Transport = "tcp",
    layers: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
) -> list[str]:
    """The command line of a non-leader rank (``layers``: "START:END", default all)."""
    addresses = ",".join(f"{h}:{p}" for h, p in loopback(ports))
    argv = [
        sys.executable,
        "-m",
        "seamline.runtime.lockstep_group",
        "--rank",
        str(rank),
        "--world",
        str(world),
        "--addresses",
        addresses,
        "--model",
        str(model),
        "--timeout",
        str(timeout_s),
        "--transport",
        transport,
        "--device",
        device,
        "--dtype",
        dtype,
    ]
    return argv + (["--layers", layers] if layers else [])


def spawn(argvs: list[list[str]], threads: int) -> list[subprocess.Popen]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return [
        subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        for argv in argvs
    ]


def start_group(
    model: Path,
    world: int,
    timeout_s: float = 30.0,
    transport: Transport = "tcp",
    worker_model: Path | None = None,
    devices: list[str] | None = None,
    dtype: str = "float32",
    layers: tuple[int, int] | None = None,
) -> tuple[LockstepGroup, list[subprocess.Popen]]:
    """Ranks 1..world-1 as subprocesses (on ``worker_model`` if given), rank 0 here; returns
    once every rank has passed HELLO. ``devices``: each rank's (default: all on the CPU);
    ``layers``: the stage the group owns (default: the whole model)."""
    ports = [free_port() for _ in range(world)]
    devices = devices or ["cpu"] * world
    span = f"{layers[0]}:{layers[1]}" if layers else None
    argvs = [
        rank_argv(
            worker_model or model, r, world, ports, timeout_s, transport, span, devices[r], dtype
        )
        for r in range(1, world)
    ]
    procs = spawn(argvs, threads_for(world))
    try:
        leader = LockstepRank(
            model,
            0,
            world,
            loopback(ports),
            timeout_s,
            DTYPES[dtype],
            transport=transport,
            layers=layers,
            device=torch.device(devices[0]),
        )
    except BaseException:
        reap(procs)
        raise
    return LockstepGroup(leader), procs


def reap(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Wait for every subprocess (killing one that hangs): [(exit code, stderr)]."""
    out = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        out.append((proc.returncode, err))
    return out


@dataclass(frozen=True)
class Reference:
    prompt: list[int]
    tokens: list[int]  # the Engine's greedy tokens
    logits: (
        torch.Tensor
    )  # [len(tokens) + 1, vocab]: row 0 after the prompt, row i after tokens[i-1]


@torch.inference_mode()
def engine_reference(engine: Engine, prompt: list[int], steps: int = STEPS) -> Reference:
    """``Engine.generate``'s greedy tokens, and the logits after the prompt and after each of
    them (one prefill forward, then one forward per token, as a sequence runs alone)."""
    assert len(prompt) <= PREFILL_CHUNK  # one prefill forward
    tokens = list(engine.generate(prompt, SamplingParams(max_tokens=steps)))
    cache = engine.stage.new_cache()
    rows = [engine.stage(torch.tensor(prompt), 0, cache, last_only=True)[-1]]
    for i, token in enumerate(tokens):
        rows.append(engine.stage(torch.tensor([token]), len(prompt) + i, cache)[-1])
    assert len(tokens) == steps
    return Reference(prompt, tokens, torch.stack(rows).float())


def generate_recording(
    group: LockstepGroup, prompt: list[int], params: SamplingParams
) -> tuple[list[int], torch.Tensor]:
    """The tokens the scheduler's loop generates over the group, and the logits of each of its
    forwards [forwards, vocab]."""
    rows: list[torch.Tensor] = []
    call = group.call

    def recording(
        op: int, seq: int, position: int = 0, inputs: Any = None, flags: int = 0
    ) -> torch.Tensor | None:
        out = call(op, seq, position, inputs, flags)
        if op in (PREFILL, DECODE):
            # a GPU rank's logits come back on its device: compared on the host
            rows.append(out.cpu())  # type: ignore[union-attr]
        return out

    group.call = recording  # type: ignore[method-assign]
    try:
        tokens = list(Engine(LockstepStage(group), group.context_length).generate(prompt, params))
    finally:
        del group.call
    return tokens, torch.stack(rows)


def check_rewind(group: LockstepGroup, prompt: list[int], token: int) -> None:
    """A decode rewound and run again recomputes the same logits, bit for bit."""
    seq = group.create()
    group.run(seq, 0, torch.tensor(prompt))
    first = group.run(seq, len(prompt), torch.tensor([token]))
    group.rewind(seq, len(prompt))
    torch.testing.assert_close(
        group.run(seq, len(prompt), torch.tensor([token])), first, atol=0, rtol=0
    )
    group.destroy(seq)


def check_group(group: LockstepGroup, ref: Reference, atol: float) -> float:
    """Greedy tokens equal to the reference's, logits within ``atol`` at every step; the max
    error. Then the (max, argmax) exchange greedy sequences use: the same tokens, each step's
    vector -inf but at the reference's argmax, there holding its max logit (within ``atol``)."""
    group.greedy_exchange = False  # whole logits, to compare every one
    try:
        tokens, logits = generate_recording(
            group, ref.prompt, SamplingParams(max_tokens=len(ref.tokens))
        )
    finally:
        group.greedy_exchange = True
    assert tokens == ref.tokens
    assert len(logits) == len(tokens)  # one forward per token drawn: none after the last
    err = (logits - ref.logits[: len(logits)]).abs().max().item()
    print(
        f"max |lockstep - engine| = {err:.2e} over {len(logits)} forwards "
        f"(logit scale {ref.logits.abs().max():.1f})"
    )
    assert err < atol, f"max |lockstep - engine| = {err:.2e} >= {atol}"
    check_rewind(group, ref.prompt, ref.tokens[0])
    check_greedy_exchange(group, ref, atol)
    return err


def check_greedy_exchange(
    group: LockstepGroup, ref: Reference, atol: float, steps: int = 8
) -> None:
    tokens, sparse = generate_recording(group, ref.prompt, SamplingParams(max_tokens=steps))
    assert tokens == ref.tokens[:steps]
    expected = ref.logits[: len(sparse)]
    finite = torch.isfinite(sparse)
    assert finite.sum(dim=1).tolist() == [1] * len(sparse), "one finite logit per step"
    assert torch.equal(sparse.argmax(dim=1), expected.argmax(dim=1))
    torch.testing.assert_close(
        sparse.max(dim=1).values, expected.max(dim=1).values, atol=atol, rtol=0
    )


@contextmanager
def running_group(
    model: Path,
    world: int,
    transport: Transport = "tcp",
    devices: list[str] | None = None,
    dtype: str = "float32",
    layers: tuple[int, int] | None = None,
) -> Iterator[LockstepGroup]:
    """A group on ``model`` with this process's threads set to its share of the CPUs; on
    exit, shut down, and every other rank must have exited cleanly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_for(world))
    group, procs = start_group(
        model, world, transport=transport, devices=devices, dtype=dtype, layers=layers
    )
    try:
        yield group
    finally:
        torch.set_num_threads(threads)
        group.close()
        results = reap(procs)
    assert all(rc == 0 for rc, _ in results), results


def run_group(
    model: Path,
    world: int,
    ref: Reference,
    atol: float = ATOL,
    transport: Transport = "tcp",
    devices: list[str] | None = None,
) -> float:
    """Start a group on ``model`` (its ranks on ``devices``) and hold it to ``ref``; the max logit error."""
    with running_group(model, world, transport, devices) as group:
        return check_group(group, ref, atol)
