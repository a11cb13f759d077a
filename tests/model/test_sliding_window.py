"""A sliding window that transformers would apply is refused, in config.json and in GGUF.

seamline attends to the whole context; a model trained with a window shorter than its context
would get silently different answers. Whether a window is active follows transformers 5's
modeling code family by family (``seamline.config.SLIDING_RULES``); inactive windows (unset,
``use_sliding_window`` false, no sliding layer, or a window >= max_position_embeddings) load,
and then match transformers to 1e-4 on fp32 logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers  # the reference: a test dependency, never skipped

from seamline.config import ModelConfig, sliding_window_active
from seamline.errors import ConfigError
from seamline.weights.gguf import GGUFSource
from seamline.weights.gguf_write import write_gguf_from_folder
from seamline.weights.loader import load_stage, open_source
from tests.support.reference import (
    PREFILL,
    random_ids,
    reference_logits,
    save_random_model,
    seamline_logits,
)

ATOL = 1e-4
SMALL = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
MOE = dict(num_local_experts=4, num_experts_per_tok=2)


def _mixtral(window: int | None) -> Any:
    return transformers.MixtralConfig(**SMALL, **MOE, sliding_window=window)


def test_active_window_is_refused(tmp_path: Path) -> None:
    window = PREFILL // 2  # shorter than the prompt: transformers masks the early tokens
    save_random_model(_mixtral(window), tmp_path / "hf")
    with pytest.raises(ConfigError, match="sliding_window 16 is active for mixtral"):
        load_stage(open_source(tmp_path / "hf"))


@pytest.mark.parametrize("window", [None, 128, 4096])
def test_inactive_window_loads_and_matches(tmp_path: Path, window: int | None) -> None:
    model = save_random_model(_mixtral(window), tmp_path / "hf")
    ids = random_ids(256)
    got = seamline_logits(load_stage(open_source(tmp_path / "hf")), ids)
    assert (got - reference_logits(model, ids)).abs().max().item() < ATOL


def _qwen(cls: Any, **kw: Any) -> dict[str, Any]:
    extra = dict(head_dim=16, num_hidden_layers=4)
    if cls is transformers.Qwen3MoeConfig:
        extra.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    return dict(cls(**{**SMALL, **extra, **kw}).to_dict())


Q2, Q3, Q3M = transformers.Qwen2Config, transformers.Qwen3Config, transformers.Qwen3MoeConfig
# (config class, use_sliding_window, sliding_window, max_window_layers) over 4 layers
QWEN_CASES = [
    (Q2, False, 16, 0), (Q2, True, 16, 2), (Q2, True, 16, 4), (Q2, True, 128, 0),
    (Q3, True, 16, 3), (Q3, False, 16, 0), (Q3M, True, 16, None), (Q3M, False, 16, None),
]  # fmt: skip


@pytest.mark.parametrize("cls,use,window,first", QWEN_CASES)
@pytest.mark.parametrize("with_layer_types", [True, False])
def test_qwen_rules_agree_with_transformers(
    cls: Any, use: bool, window: int, first: int | None, with_layer_types: bool
) -> None:
    """Active exactly when transformers' own config gives some layer a binding window."""
    kw: dict[str, Any] = dict(use_sliding_window=use, sliding_window=window)
    if first is not None:
        kw["max_window_layers"] = first
    d = _qwen(cls, **kw)
    config = cls(**{k: v for k, v in d.items() if k != "transformers_version"})
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    applied = config.sliding_window
    expected = applied is not None and applied < 128 and "sliding_attention" in types
    if not with_layer_types:
        d.pop("layer_types", None)  # an older config.json: max_window_layers decides
        if cls is not Q3M:
            d["sliding_window"] = window  # as written before transformers 5
    assert sliding_window_active(d["model_type"], d) == expected, d
    if expected:
        with pytest.raises(ConfigError, match="sliding_window"):
            ModelConfig.from_hf_dict(d)
    else:
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
def test_families_without_a_window_ignore_the_field(model_type: str) -> None:
    assert not sliding_window_active(model_type, {"sliding_window": 4, "use_sliding_window": True})


@pytest.mark.parametrize("kind,window,refused", [
    ("mixtral", 16, True), ("mixtral", 128, False), ("mistral", 16, True), ("mistral", 512, False),
])  # fmt: skip
def test_gguf_window_is_carried_and_refused(
    tmp_path: Path, kind: str, window: int, refused: bool
) -> None:
    """llama.cpp's {arch}.attention.sliding_window reaches the config (a llama-arch file with
    one reads back as model_type mistral, whose window transformers applies)."""
    config = (
        _mixtral(window) if kind == "mixtral"
        else transformers.MistralConfig(**SMALL, sliding_window=window)
    )  # fmt: skip
    save_random_model(config, tmp_path / "hf")
    path = write_gguf_from_folder(tmp_path / "hf", tmp_path / "m.gguf", "F32")
    d = GGUFSource(path).config_dict()
    assert d["sliding_window"] == window and d["model_type"] == kind
    if refused:
        with pytest.raises(ConfigError, match=f"sliding_window {window} is active"):
            load_stage(open_source(path))
    else:
        load_stage(open_source(path))
