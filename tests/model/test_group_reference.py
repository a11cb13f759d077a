"""The coordinator's reference computes a lockstep group's layers as the group does: every rank's
shard on a thread, the gates summed in rank order (``mesh.control.reference_group``).

Rank 1 is another process over TCP. The embedded model in bfloat16 (as the default precision
runs it, less the int8 blocks that need VNNI): the group's start-up probe answers as the
reference's thread-ranks to within 1% of the checks' tolerance, over whole-model and
mid-model (hidden-state input, no head) probes, while the unsplit layers' answers lie 10-900%
of the tolerance away (measured over 30 random probes of the whole model; one in ten failed
the check before the reference computed as the group does).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from seamline.app import default_model_path
from seamline.mesh.control.reference import Reference
from seamline.parallel.comm import CommError, DesyncError, GateTag
from seamline.parallel.thread_comm import ThreadGroup, run_ranks
from seamline.runtime import digest
from seamline.runtime.group_stage import LockstepStage
from seamline.weights.packaging import package_cached
from tests.support.lockstep_harness import running_group

SAME = 0.01  # of the tolerance: the group and its reference differ by no more (observed: 0, bit for bit)
PROBES = 3


def _gaps(
    reference: Reference, stage: LockstepStage, layers: tuple[int, int], seed: int
) -> list[tuple[float, float]]:
    """(gap from the thread-ranks' answer, gap from the unsplit layers') of random probes."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for probe_seed in range(PROBES):
        ids, hidden = reference.probe_inputs(layers, generator)
        output, start = digest.probe_output(stage, ids, hidden)
        got = digest.digest(output, start, probe_seed)
        as_group = reference.probe(layers, ids, hidden, probe_seed, world=2)
        unsplit = reference.probe(layers, ids, hidden, probe_seed)
        out.append(
            (
                digest.differs(got, *as_group, torch.bfloat16),
                digest.differs(got, *unsplit, torch.bfloat16),
            )
        )
    return out


@pytest.mark.parametrize("layers", [(0, 30), (10, 20)])
def test_a_group_answers_its_probe_as_the_reference_computes_a_group(
    tmp_path: Path, layers: tuple[int, int]
) -> None:
    package = package_cached(default_model_path(), tmp_path, progress=False)
    reference = Reference(package, "bfloat16")
    with running_group(
        package, 2, dtype="bfloat16", layers=None if layers == (0, 30) else layers
    ) as group:
        gaps = _gaps(reference, LockstepStage(group), layers, seed=layers[0])
    print("gaps (as the group, unsplit):", gaps)
    assert all(as_group < SAME for as_group, _ in gaps), gaps
    assert max(unsplit for _, unsplit in gaps) > SAME, (
        gaps
    )  # the unsplit arithmetic would not pass: the test can fail


def test_a_groups_sequence_runs_step_by_step_as_the_reference_runs_it(tmp_path: Path) -> None:
    """The live checks' path (``--verify-fraction``): a prompt, then one token at a time on the
        same caches (one per rank on the reference's side), each step's logits the group's (to within
    ``SAME``; observed: equal to the bit)."""
    package = package_cached(default_model_path(), tmp_path, progress=False)
    reference = Reference(package, "bfloat16")
    ids = torch.tensor(
        [1, 330, 3458, 282, 4649, 314, 253, 1789]
    )  # any ids: a prompt, then three tokens
    with running_group(package, 2, dtype="bfloat16") as group:
        stage = LockstepStage(group)
        mine, theirs = stage.new_cache(), reference.stage((0, 30), 2).new_cache()
        for start, end in ((0, 5), (5, 6), (6, 7), (7, 8)):
            got = stage(ids[start:end], start, mine, last_only=True)
            expected = reference.run(
                reference.stage((0, 30), 2), ids[start:end], start, theirs, True
            )
            gap = digest.differs(
                digest.digest(got[-1:], 0, 7),
                digest.digest(expected[-1:], 0, 7),
                digest.scale(expected[-1:], 0, 7),
                torch.bfloat16,
            )
            assert gap < SAME, f"positions [{start},{end}): {gap:.3f} of the tolerance"
        stage.release_cache(mine)


def test_thread_ranks_sum_in_rank_order_and_gather_in_rank_order() -> None:
    group = ThreadGroup(2)
    comms = group.comms()
    parts = [
        torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
        torch.tensor([0.5, 0.25], dtype=torch.bfloat16),
    ]
    sums = run_ranks(
        group, [lambda c=c, p=p: c.all_reduce(p, GateTag(0, 0, 0)) for c, p in zip(comms, parts)]
    )
    assert all(s.tolist() == [1.5, 2.25] and s.dtype == torch.bfloat16 for s in sums)
    gathered = run_ranks(group, [lambda c=c, p=p: c.all_gather(p, 0) for c, p in zip(comms, parts)])
    assert gathered[1].tolist() == [1.0, 2.0, 0.5, 0.25]


def test_thread_ranks_at_different_gates_or_a_failed_rank_raise_and_none_hangs() -> None:
    group = ThreadGroup(2)
    comms = group.comms()
    with pytest.raises(DesyncError, match="different gates"):
        run_ranks(
            group,
            [
                lambda c=c, g=g: c.all_reduce(torch.ones(2), GateTag(0, g, 0))
                for c, g in zip(comms, (0, 1))
            ],
        )

    def fails() -> torch.Tensor:
        raise ValueError("this rank's forward failed")

    group = ThreadGroup(2)
    comms = group.comms()
    started = threading.Event()

    def waits() -> torch.Tensor:
        started.set()
        return comms[1].all_reduce(torch.ones(2), GateTag(0, 0, 0))

    with pytest.raises(
        ValueError, match="forward failed"
    ):  # the failure itself, not its echo on rank 1
        run_ranks(group, [fails, waits])
    assert started.is_set()
    with pytest.raises(CommError, match="another thread-rank failed"):  # the group stays broken
        comms[0].all_reduce(torch.ones(2), GateTag(0, 0, 1))
