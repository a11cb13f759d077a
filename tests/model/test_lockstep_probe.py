"""A lockstep group copies a sequence's cache on every rank (the FORK command), and the speed
probe runs through the whole group: its every rank and gate, as the group serves.

Rank 1 is another process over TCP (``running_group``). A copy of a prefilled sequence's first
positions, fed the rest of the prompt, gives the logits the whole prompt gave (float32,
``ATOL``); a copy the ranks cannot make is refused on every rank alike and the group serves
on; the probe leaves no sequence behind on the ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from seamline.errors import RequestError
from seamline.runtime.group_stage import LockstepStage
from seamline.runtime.step_probe import NotProbed, probe_prompt, probe_steps
from tests.support.configs import checkpoint_folder
from tests.support.lockstep_harness import ATOL, PROMPT, running_group

SPLIT = 5  # positions the copy takes from the prefilled sequence


def test_a_copied_sequence_goes_on_as_the_original(tmp_path: Path) -> None:
    with running_group(checkpoint_folder("dense", tmp_path), 2) as group:
        stage = LockstepStage(group)
        ids = torch.tensor(PROMPT)
        whole = stage.new_cache()
        expected = stage.forward(ids, 0, whole, last_only=True)
        copy = whole.fork(SPLIT)
        got = stage.forward(ids[SPLIT:], SPLIT, copy, last_only=True)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        with pytest.raises(RequestError, match="cannot be copied"):
            whole.fork(len(PROMPT) + 1)  # past what it holds
        with pytest.raises(RequestError, match="not one open"):
            group.fork(999, 1)  # no such sequence
        again = stage.forward(
            ids[SPLIT:], SPLIT, whole.fork(SPLIT), last_only=True
        )  # still serving, in step
        torch.testing.assert_close(again, expected, atol=ATOL, rtol=0)


def test_the_probe_steps_through_the_group_and_leaves_nothing(tmp_path: Path) -> None:
    with running_group(checkpoint_folder("dense", tmp_path), 2) as group:
        stage = LockstepStage(group)
        steps = probe_steps(stage, rows=(1, 4), repeats=1, depth=8)
        prompts = probe_prompt(
            stage, rows=(8, 16), repeats=1, chunk=8
        )  # 16 rows: two sequences' chunks
        assert set(steps) == {1, 4} and all(s > 0 for s in steps.values())
        assert set(prompts) == {8, 16} and all(s > 0 for s in prompts.values())
        assert group.leader.seqs == {}  # every copy and prefilled sequence released on the ranks


def test_a_group_whose_caches_cannot_be_copied_is_not_probed(tmp_path: Path) -> None:
    with running_group(checkpoint_folder("deepseek_v4", tmp_path), 2) as group:
        with pytest.raises(NotProbed):
            probe_steps(LockstepStage(group), rows=(1,), repeats=1, depth=8)
        assert group.leader.seqs == {}
