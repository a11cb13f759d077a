"""Dense families against transformers: logits within 1e-4 (fp32) over prefill + decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from seamline.weights.loader import load_stage, open_source
from tests.support.configs import dense_configs
from tests.support.reference import (
    random_ids,
    reference_logits,
    save_random_model,
    seamline_logits,
    split_logits,
)

ATOL = 1e-4


@pytest.mark.parametrize("name", list(dense_configs()))
def test_logits_match_transformers(name: str, tmp_path: Path) -> None:
    model = save_random_model(dense_configs()[name], tmp_path)
    stage = load_stage(open_source(tmp_path))
    ids = random_ids(256)
    expected = reference_logits(model, ids)
    got = seamline_logits(stage, ids)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("cut", [1, 2])
def test_stage_split_equals_whole(cut: int, tmp_path: Path) -> None:
    model = save_random_model(dense_configs()["qwen2"], tmp_path)
    ids = random_ids(256)
    whole = seamline_logits(load_stage(open_source(tmp_path)), ids)
    torch.testing.assert_close(split_logits(tmp_path, cut, ids), whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(whole, reference_logits(model, ids), atol=ATOL, rtol=0)


def test_vocab_shards_concatenate_to_full_head(tmp_path: Path) -> None:
    from seamline.ownership import Ownership

    save_random_model(dense_configs()["llama-tied"], tmp_path)
    source = open_source(tmp_path)
    ids = random_ids(256)
    whole = seamline_logits(load_stage(source), ids)
    halves = [load_stage(source, Ownership(layers=(0, 3), vocab=v)) for v in ((0, 100), (100, 256))]
    assert halves[0].head is not None and halves[0].head.shape == (100, 64)
    parts = [seamline_logits(stage, ids) for stage in halves]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=0)


def test_stage_allocates_only_owned_layers(tmp_path: Path) -> None:
    from seamline.ownership import Ownership

    save_random_model(dense_configs()["llama"], tmp_path)
    stage = load_stage(open_source(tmp_path), Ownership(layers=(1, 2)))
    assert list(stage.layers.keys()) == ["1"]
    assert stage.embed is None and stage.head is None
