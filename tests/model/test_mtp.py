"""DeepSeek-V3's multi-token-prediction layer: its drafts against the published formula, and
speculation with it changes no token.

A random V3 checkpoint gets a random MTP layer (layer ``num_hidden_layers``, as DeepSeek's
checkpoints store it). The layer's draft logits over a prompt must equal a float64 reference of
``eh_proj(concat[enorm(embed(t+1)), hnorm(h_t)])`` → the block → ``shared_head.norm`` → the head,
built from transformers' own DeepSeek-V3 layer, within 1e-4; generating with its drafts must
give the tokens generated without them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from seamline.errors import CheckpointError
from seamline.params import SamplingParams
from seamline.runtime.speculation import Speculation
from seamline.weights.loader import load_stage, open_source
from tests.support.cli import assert_clean_error, seamline
from tests.support.deepseek import (
    MtpLayer,
    add_mtp_layer,
    build_deepseek,
    deepseek_tokens,
    mtp_reference_logits,
    silence_outputs,
)
from tests.support.speculation import (
    COOL,
    GREEDY,
    SEEDED,
    assert_mtp_changes_no_token,
    assert_right_drafts_save_steps,
    mtp_draft_logits,
)

ATOL = 1e-4


@pytest.fixture(scope="module")
def v3_with_mtp(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, MtpLayer, Path]:
    model, folder = build_deepseek(tmp_path_factory.mktemp("mtp"), "v3")
    layer = add_mtp_layer(model, folder)
    return model, layer, folder


def test_mtp_draft_logits_follow_the_published_formula(
    v3_with_mtp: tuple[torch.nn.Module, MtpLayer, Path],
) -> None:
    model, layer, folder = v3_with_mtp
    ids = deepseek_tokens()
    ours = mtp_draft_logits(folder, ids)
    reference = mtp_reference_logits(model, layer, ids).float()
    assert ours.shape == reference.shape
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_mtp_drafts_change_no_token(
    v3_with_mtp: tuple[torch.nn.Module, MtpLayer, Path], params: SamplingParams
) -> None:
    assert_mtp_changes_no_token(v3_with_mtp[2], deepseek_tokens().tolist()[:32], params)


def test_mtp_asked_of_a_checkpoint_without_its_tensors_is_refused(tmp_path: Path) -> None:
    _, folder = build_deepseek(
        tmp_path, "v3"
    )  # its config declares one layer; the tensors are not there
    with pytest.raises(
        CheckpointError,
        match="lacks tensor model.layers.3.enorm.weight of its multi-token-prediction",
    ):
        load_stage(open_source(folder), mtp=True)
    load_stage(open_source(folder))  # without drafts it loads: the layer is not needed


def test_a_misshapen_mtp_tensor_is_named(tmp_path: Path) -> None:
    model, folder = build_deepseek(tmp_path, "v3")
    add_mtp_layer(model, folder)
    tensors = load_file(folder / "model-mtp.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = tensors["model.layers.3.eh_proj.weight"][
        :, :64
    ].contiguous()
    save_file(tensors, folder / "model-mtp.safetensors")
    with pytest.raises(
        CheckpointError, match=r"model.layers.3.eh_proj.weight gives mtp.eh_proj shape \(64, 64\)"
    ):
        load_stage(open_source(folder), mtp=True)


def test_the_command_line_refuses_mtp_for_a_model_without_it(tmp_path: Path) -> None:
    proc = seamline("run", "-p", "hi", "--max-tokens", "2", "--speculative", "mtp")
    assert_clean_error(proc, "the llama checkpoint has no multi-token-prediction layer")
    _, folder = build_deepseek(tmp_path, "v3")  # declares the layer; its tensors are not there
    proc = seamline(
        "serve", "--model", str(folder), "--speculative", "mtp", "--port", "1"
    )  # a mesh: before it packages
    assert_clean_error(
        proc, "--speculative mtp: the checkpoint lacks tensor model.layers.3.enorm.weight"
    )


def test_right_mtp_drafts_are_accepted_and_save_steps(tmp_path: Path) -> None:
    """A model whose layers add nothing, with a layer that computes what it computes for the
    next token: greedy, its drafts are right (accepted, in fewer steps); seeded at a low temperature, the draws agree
    with the argmax drafts at some positions only (windows end part way). Tokens never change."""
    model, folder = build_deepseek(tmp_path, "v3")
    silence_outputs(model)
    model.save_pretrained(folder)
    add_mtp_layer(model, folder, echo=True)
    prompt = deepseek_tokens().tolist()[:32]
    stage = load_stage(open_source(folder), mtp=True)
    speculation = Speculation("mtp", draft_max=4).for_model(True)
    assert_right_drafts_save_steps(stage, prompt, speculation, GREEDY, COOL, steps_share=1 / 2)
