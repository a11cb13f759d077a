"""Speculative windows on a 2-rank lockstep group: the output with speculation is its output
without, greedy and seeded.

The leader's scheduler drafts (partly right, so windows end after 0, 1 or 2 accepted drafts)
and the mirrored BATCH command carries each window flagged, so every rank computes its rows
as one-row steps and the head gathers every row's logits; the next rows start at the first
rejected position on every rank with no REWIND. Each family (a dense Llama, Mixtral,
DeepSeek-V3's latent attention, DeepSeek-V4, whose caches take the rejected positions back
at the next step) runs in a real group: rank 1 is another process over TCP.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from seamline.runtime.group_stage import LockstepStage
from seamline.runtime.speculation import OFF, Speculation
from tests.support.configs import checkpoint_folder
from tests.support.lockstep_harness import running_group
from tests.support.speculation import (
    GREEDY,
    SEEDED,
    TOKENS,
    generate,
    partly_right,
    repetitive_prompt,
)


@pytest.mark.parametrize("kind", ["dense", "mixtral", "deepseek_v3", "deepseek_v4"])
def test_a_lockstep_group_verifies_windows_and_changes_no_token(kind: str, tmp_path: Path) -> None:
    folder = checkpoint_folder(kind, tmp_path)
    with running_group(folder, 2) as group:
        stage = LockstepStage(group)
        assert stage.verifies_drafts
        prompt = repetitive_prompt(stage.config.vocab_size)
        for params in (GREEDY, SEEDED):
            plain, _, _ = generate(stage, prompt, params, OFF)
            speculation = Speculation("ngram", source=partly_right(len(prompt))(plain))
            drafted, _, stats = generate(stage, prompt, params, speculation)
            assert len(plain) == TOKENS
            assert drafted == plain
            assert 0 < stats.accepted < stats.drafted
