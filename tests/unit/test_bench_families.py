"""`seamline bench families`'s parts on tiny shapes: the random checkpoints name their tensors as
a folder of the family does, load and give finite logits past their window; the KV figures and
their bound; the JSON's fields, with the meshes' runs stood in for. (The full benchmark, with
its meshes over the emulated LAN, is run by hand.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from seamline.config import ModelConfig
from seamline.weights.loader import load_stage, open_source
from seamline_bench import families
from seamline_bench.family_models import SHAPES, RandomFamily, file_types, tiny, write_family

VOCAB = 256  # no tokenizer: the stage is fed ids
SLIDING = {"gpt_oss": [0], "gemma3": [0, 1, 2, 3, 4], "glm4_moe": []}


@pytest.mark.parametrize("family", list(SHAPES))
def test_random_tensors_are_those_of_a_folder_of_the_family(family: str, tmp_path: Path) -> None:
    from transformers import AutoConfig

    from seamline.weights.safetensors import HFFolderSource
    from tests.support.reference import save_random_model

    config = tiny(family, VOCAB)
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    save_random_model(AutoConfig.for_model(config["model_type"], **kwargs), tmp_path / "hf")
    folder = HFFolderSource(tmp_path / "hf")
    ours = RandomFamily(config)
    assert ours.names() == folder.names()
    assert {n: ours.shape(n) for n in ours.names()} == {
        n: tuple(folder.shape(n)) for n in folder.names()
    }


@pytest.mark.parametrize("family", list(SHAPES))
def test_a_tiny_family_file_loads_and_decodes_past_its_window(family: str, tmp_path: Path) -> None:
    path = write_family(tmp_path / f"{family}.gguf", tiny(family, VOCAB))
    assert path.is_file() and not path.with_suffix(".partial").exists()
    types = file_types(path)
    assert types["counts"]["Q4_K"] > 0 and "Q4_K" not in {
        t for ts in types["not_q4_k"].values() for t in ts
    }
    stage = load_stage(open_source(path))
    assert sorted(stage.config.sliding_layers) == SLIDING[family]
    cache, ids = stage.new_cache(), torch.arange(20) % VOCAB  # the tiny windows are 8 positions
    rows = [stage(ids, 0, cache, last_only=True)]
    rows += [stage(torch.tensor([i]), 20 + i, cache, last_only=True) for i in range(4)]
    logits = torch.cat(rows)
    assert logits.shape == (5, VOCAB) and torch.isfinite(logits).all() and logits.std() > 0


def test_kv_target_is_the_window_and_its_slack_on_sliding_layers() -> None:
    oss, gemma, glm = (
        ModelConfig.from_hf_dict(SHAPES[f]) for f in ("gpt_oss", "gemma3", "glm4_moe")
    )
    assert families.kv_target(oss) == (128 + 32 + 8192) / (2 * 8192)
    assert families.kv_target(gemma) == (5 * (512 + 32) + 8192) / (6 * 8192)
    assert families.kv_target(glm) == 1.0
    assert (
        families.kv_target(oss, tokens=100) == 1.0
    )  # a window longer than the sequence saves nothing


def test_without_a_window_kv_ratio_is_one() -> None:
    kv = families.kv_figures(ModelConfig.from_hf_dict(SHAPES["glm4_moe"]))
    assert kv["kv_ratio_8k"] == 1.0 and kv["kv_ratio_met"] and kv["sliding_layers"] == []
    per_token = 2 * 8 * 128 * 4 * 2  # k and v, 8 heads of 128, float32, 2 layers
    assert kv["kv_bytes_per_token_8k"] == {"windowed": per_token, "without_windows": per_token}


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3"])
def test_sliding_layers_hold_at_most_their_window_at_8k(family: str) -> None:
    kv = families.kv_figures(ModelConfig.from_hf_dict(SHAPES[family]))
    assert kv["sliding_layers"] == SLIDING[family]
    assert kv["kv_ratio_8k"] < 1.0
    assert kv["kv_ratio_8k"] <= kv["kv_target_8k"] and kv["kv_ratio_met"]
    assert kv["kv_bytes_per_token_8k"]["windowed"] < kv["kv_bytes_per_token_8k"]["without_windows"]


def _fake_measure(
    path: Path, repeats: int, lan_reason: str
) -> tuple[dict[str, list[dict[str, Any]]], list[Any]]:
    if "glm4_moe" in path.name:
        raise RuntimeError("no mesh today")
    tokens = list(range(32))
    runs = {
        "single": [{"seconds": 2.0, "tokens": tokens}] * repeats,
        "loopback": [{"seconds": 2.5, "tokens": tokens}] * repeats,
        "lan": [{"seconds": 4.0, "tokens": tokens}] * repeats,
    }
    return runs, [[0, 1], [1, 2]]


def test_the_json_has_each_family_its_figures_and_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(families, "lan_up", lambda: "")
    monkeypatch.setattr(families, "lan_down", lambda: None)
    monkeypatch.setattr(families, "measure", _fake_measure)
    monkeypatch.setattr(
        families,
        "family_path",
        lambda f, root: write_family(tmp_path / f"{f}.gguf", tiny(f, VOCAB)),
    )
    out = families.bench_families(repeats=2, families=("gpt_oss", "glm4_moe"))
    oss = out["families"]["gpt_oss"]
    assert (oss["split_ratio_lan"], oss["split_ratio_loopback"]) == (0.5, 0.8)
    assert (oss["single_tok_s"], oss["lan_tok_s"], oss["generated_tokens"]) == (16.0, 8.0, 32)
    assert oss["shape"]["hidden_size"] == 2880 and oss["shape"]["num_local_experts"] == 32
    assert (
        oss["file_bytes"] == (tmp_path / "gpt_oss.gguf").stat().st_size
        and "Q4_K" in oss["types"]["counts"]
    )
    assert {"kv_ratio_8k", "kv_target_8k", "kv_ratio_met", "kv_bytes_per_token_8k"} <= set(oss)
    assert oss["stages"] == [[0, 1], [1, 2]] and oss["tokens_match"]
    glm = out["families"]["glm4_moe"]
    assert glm["error"] == "RuntimeError: no mesh today" and "split_ratio_lan" not in glm
    assert glm["kv_ratio_8k"] == 1.0 and glm["shape"]["n_routed_experts"] == 128 and "note" in glm
    assert out["targets_met"]["gpt_oss.split_ratio_lan"] is False
    assert out["targets_met"]["glm4_moe.split_ratio_lan"] is None
    assert out["targets"]["split_ratio_lan"] == 0.9 and out["lan_reason"] == ""


def test_a_large_model_does_not_share_the_machine_with_its_meshes() -> None:
    assert families.fits_together(2 << 30)
    assert not families.fits_together(7 << 30)
