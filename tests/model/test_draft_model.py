"""A smaller model with the same vocabulary drafts (``--draft-model``): the output with its
drafts is the output without, and a model that drafts what the target would say has its
drafts accepted.

The embedded model drafts for itself here (float32, the exact path): greedy, every draft is
the target's own next token, so windows are accepted whole, in fewer steps; seeded, draws
agree with the greedy drafts only some of the time. Two sequences drafted for in turn keep
their own caches. A checkpoint of another vocabulary is refused in one line, and a mesh
refuses the option.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from seamline.app import LocalModel, default_model_path
from seamline.errors import ConfigError
from seamline.runtime.core import EngineCore
from seamline.runtime.draft_model import DraftModel, draft_share
from seamline.runtime.speculation import OFF, Speculation
from seamline.weights.loader import load_stage, open_source
from tests.support.cli import assert_clean_error, seamline
from tests.support.configs import checkpoint_folder
from tests.support.speculation import (
    GREEDY as GREEDY_64,
)
from tests.support.speculation import (
    LIST,
    assert_right_drafts_save_steps,
    generate,
)
from tests.support.speculation import (
    SEEDED as SEEDED_64,
)

GREEDY, SEEDED = (
    replace(GREEDY_64, max_tokens=24),
    replace(SEEDED_64, max_tokens=24),
)  # the model drafts for itself: slow


@pytest.fixture(scope="module")
def target() -> LocalModel:
    return LocalModel.load(default_model_path())


def _drafting(model: LocalModel) -> Speculation:
    stage = model.engine.stage
    drafting = DraftModel.load(default_model_path(), stage.config, stage.compute_dtype)
    return Speculation("auto", draft_max=6, source=drafting.draft)


def test_a_model_drafting_for_itself_is_accepted_and_changes_no_token(target: LocalModel) -> None:
    prompt = target.codec.encode_chat([{"role": "user", "content": "Tell me about the sea."}])
    assert_right_drafts_save_steps(
        target.engine.stage,
        prompt,
        _drafting(target),
        GREEDY,
        SEEDED,
        steps_share=1 / 3,
        sampled_accepts=False,
    )


def test_sequences_drafted_for_in_turn_keep_their_own_caches(target: LocalModel) -> None:
    prompts = [
        target.codec.encode_chat([{"role": "user", "content": text}])
        for text in (LIST, "Name three rivers.")
    ]
    alone = [generate(target.engine.stage, p, GREEDY, OFF)[0] for p in prompts]
    core = EngineCore.local(target.engine.stage, 4096, speculation=_drafting(target))
    sequences = [core.scheduler.add(p, GREEDY) for p in prompts]
    while not all(s.finished for s in sequences):
        core.step()
    assert [s.tokens for s in sequences] == alone
    stats = core.scheduler.speculated
    assert stats.accepted >= 0.9 * stats.drafted > 0


def test_a_draft_model_of_another_vocabulary_is_refused(target: LocalModel, tmp_path: Path) -> None:
    folder = checkpoint_folder("dense", tmp_path)
    vocab = load_stage(open_source(folder)).config.vocab_size
    message = rf"--draft-model {folder}: its vocabulary has {vocab} tokens, the model's {target.engine.stage.config.vocab_size}"
    with pytest.raises(ConfigError, match=message):
        DraftModel.load(folder, target.engine.stage.config, target.engine.stage.compute_dtype)
    assert_clean_error(
        seamline("run", "-p", "hi", "--max-tokens", "2", "--draft-model", str(folder)),
        "its vocabulary has",
    )
    as_vllm = json.dumps(
        {"model": str(folder), "num_speculative_tokens": 4}
    )  # vLLM's spelling of the same
    assert_clean_error(
        seamline("run", "-p", "hi", "--max-tokens", "2", "--speculative-config", as_vllm),
        "its vocabulary has",
    )
    assert_clean_error(
        seamline("serve", "--draft-model", str(folder), "--port", "1"),
        "--draft-model drafts on one process",
    )
    assert_clean_error(
        seamline("run", "-p", "hi", "--draft-model", str(folder), "--speculative", "off"),
        "--draft-model drafts in place of n-grams: not with --speculative off",
    )


def test_the_drafting_caches_keep_within_their_share_of_the_kv_budget(target: LocalModel) -> None:
    """Three sequences drafted for in turn with room for about one's caches: the least recently
    used go, the kept ones stay within the budget (but the one in use), and no token changes.
    The share of a budget is the drafting model's bytes per token over both models'."""
    stage = target.engine.stage
    drafting = DraftModel.load(default_model_path(), stage.config, stage.compute_dtype)
    prompts = [
        target.codec.encode_chat([{"role": "user", "content": text}])
        for text in (LIST, "Name three rivers.", "Hi")
    ]
    drafting.budget_bytes = stage.cache_bytes(len(prompts[0]) + 40)
    alone = [generate(stage, p, GREEDY, OFF)[0] for p in prompts]
    core = EngineCore.local(
        stage, 4096, speculation=Speculation("auto", draft_max=6, source=drafting.draft)
    )
    sequences = [core.scheduler.add(p, GREEDY) for p in prompts]
    most = 0
    while not all(s.finished for s in sequences):
        core.step()
        assert len(drafting._caches) == 1 or drafting.held_bytes() <= drafting.budget_bytes
        most = max(most, len(drafting._caches))
    assert most < len(prompts)  # caches went for want of room
    assert [s.tokens for s in sequences] == alone
    assert draft_share(1000, stage, drafting.stage) == 500  # the same model: half


def test_a_server_gives_the_drafting_caches_their_share_of_the_kv_budget() -> None:
    """``serve --single --draft-model``: the scheduler admits into what the drafting caches leave
    (the embedded model drafting for itself: half each)."""
    from seamline.server.serve_local import local_backend

    total = 1 << 30
    speculation = Speculation("auto", draft_max=4, draft_model=str(default_model_path()))
    backend, _ = local_backend(None, None, 512, total, "exact", speculation)
    try:
        drafting = backend.core.scheduler.speculation.source.__self__  # type: ignore[union-attr]
        assert isinstance(drafting, DraftModel) and drafting.budget_bytes == total // 2
        assert backend.core.scheduler.kv_budget_bytes == total - drafting.budget_bytes
    finally:
        backend.close()
