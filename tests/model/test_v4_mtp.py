"""DeepSeek-V4's multi-token-prediction layer: its drafts against DeepSeek's formula, and
speculation with it changes no token.

A random V4 checkpoint (written by transformers) gets a random MTP layer in the original
checkpoint's spelling (``mtp.0.*``). The layer's draft logits over a prompt must equal a
float64 reference (``e_proj(enorm(embed(t+1))) + h_proj(hnorm(h_t))`` on every residual stream
→ a transformers V4 block → the layer's hyper-head and norm → the model's head) within 1e-4;
generating with its drafts must give the tokens generated without them; a layer that echoes
the model has its greedy drafts accepted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from seamline.errors import CheckpointError
from seamline.ownership import Ownership
from seamline.params import SamplingParams
from seamline.runtime.speculation import OFF, Speculation
from seamline.weights.loader import load_stage, open_source
from tests.support.pipeline import Pipeline
from tests.support.speculation import (
    COOL,
    GREEDY,
    SEEDED,
    assert_mtp_changes_no_token,
    assert_right_drafts_save_steps,
    mtp_draft_logits,
    repetitive_prompt,
)
from tests.support.v4_mtp import V4MtpLayer, add_v4_mtp, silence_v4, v4_mtp_reference_logits
from tests.support.v4_reference import random_v4, v4_config

ATOL = 1e-4


def _checkpoint(folder: Path, echo: bool = False) -> tuple[torch.nn.Module, V4MtpLayer, Path]:
    model = random_v4(v4_config())
    if echo:
        silence_v4(model)
    model.save_pretrained(folder)
    return model, add_v4_mtp(model, folder, echo=echo), folder


@pytest.fixture(scope="module")
def v4_with_mtp(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[torch.nn.Module, V4MtpLayer, Path]:
    return _checkpoint(tmp_path_factory.mktemp("v4mtp"))


def test_v4_mtp_draft_logits_follow_the_reference(
    v4_with_mtp: tuple[torch.nn.Module, V4MtpLayer, Path],
) -> None:
    model, layer, folder = v4_with_mtp
    ids = torch.randint(0, 96, (13,), generator=torch.Generator().manual_seed(4))
    ours = mtp_draft_logits(folder, ids)
    reference = v4_mtp_reference_logits(model, layer, ids).float()
    assert ours.shape == reference.shape
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_v4_mtp_drafts_change_no_token(
    v4_with_mtp: tuple[torch.nn.Module, V4MtpLayer, Path], params: SamplingParams
) -> None:
    assert_mtp_changes_no_token(v4_with_mtp[2], repetitive_prompt(96), params)


def test_right_v4_mtp_drafts_are_accepted_and_save_steps(tmp_path: Path) -> None:
    _, _, folder = _checkpoint(tmp_path, echo=True)
    prompt = repetitive_prompt(96)
    stage = load_stage(open_source(folder), mtp=True)
    speculation = Speculation("mtp", draft_max=4).for_model(True)
    assert_right_drafts_save_steps(stage, prompt, speculation, GREEDY, COOL, steps_share=1 / 2)


def test_a_v4_checkpoint_without_its_mtp_tensors_is_refused_for_mtp(tmp_path: Path) -> None:
    random_v4(v4_config()).save_pretrained(
        tmp_path
    )  # declares one layer (num_nextn_predict_layers); no mtp.* tensors
    with pytest.raises(
        CheckpointError, match="lacks tensor mtp.0.e_proj.weight of its multi-token-prediction"
    ):
        load_stage(open_source(tmp_path), mtp=True)
    load_stage(open_source(tmp_path))


@pytest.mark.parametrize("params", [GREEDY, COOL], ids=["greedy", "cool"])
def test_a_pipelines_last_stage_drafts_over_every_prompt_position(
    tmp_path: Path, params: SamplingParams
) -> None:
    """Two stages in one process, the prompt in chunks of 8 rows: the last stage's drafting
    layer takes a chunk's last row when the next chunk's first token comes (its cache has every
    position, as a V4 cache must); the tokens are those without drafts, and drafts are taken."""
    _, _, folder = _checkpoint(tmp_path, echo=True)
    source = open_source(folder)
    layers = load_stage(source).config.num_layers
    prompt = repetitive_prompt(96)
    runs = []
    for speculation in (OFF, Speculation("mtp", draft_max=4).for_model(True)):
        stages = [
            load_stage(source, Ownership(layers=(0, 1))),
            load_stage(source, Ownership(layers=(1, layers)), mtp=True),
        ]
        pipeline = Pipeline(stages, speculation)
        try:
            pipeline.workers[0].head.scheduler.max_step_tokens = 8  # type: ignore[union-attr]
            tokens = pipeline.generate(1, prompt, params)
            cache = pipeline.workers[-1].sequences[1].cache
            runs.append((tokens, pipeline.workers[0].speculated()))
        finally:
            pipeline.close()
        drafting = cache.layer(stages[-1].mtp.layer)
        assert drafting.length == len(prompt) + len(tokens) - 1, (
            "a position of the drafting layer's cache is missing"
        )
    (plain, _), (drafted, stats) = runs
    assert drafted == plain
    assert stats["windows"] > 0 and stats["accepted"] > 0, stats
