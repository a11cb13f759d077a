"""Sliding-window attention, as transformers applies config.json's ``sliding_window``.

Random checkpoints written by transformers with a window (8) shorter than the prompt (32), so the
window hides keys: Mistral and Mixtral (every layer), Qwen2 (from ``max_window_layers`` on),
Qwen3 (``layer_types`` alternating) and Qwen3-MoE (every layer). Their float32 logits must equal
transformers' within 1e-4 at once, in chunks and decoding one token at a time; 32 greedy tokens
equal transformers' own; a 2-stage split and a 2-rank lockstep group equal the single process;
sequences batched together equal each alone; a prompt that forks a cached prefix longer than the
window equals a fresh prefill. Which layers a window restricts follows transformers' own config
class (``seamline.config.SLIDING_RULES``); a window of max_position_embeddings or more never binds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the reference: a test dependency, never skipped

from seamline.config import ModelConfig, sliding_layers, sliding_window_active
from seamline.params import SamplingParams
from seamline.runtime.core import EngineCore
from seamline.runtime.engine import Engine
from seamline.weights.gguf import GGUFSource
from seamline.weights.gguf_write import write_gguf_from_folder
from seamline.weights.loader import load_stage, open_source
from tests.support.family_checks import (
    assert_greedy_matches,
    assert_group_matches,
    assert_logits_match,
    assert_split_matches,
)
from tests.support.reference import (
    random_ids,
    reference_logits,
    save_random_model,
    seamline_logits,
)

ATOL = 1e-4
WINDOW = 8  # shorter than PREFILL: the early tokens fall out of the window
SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    head_dim=16,
)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
SLIDING, FULL = "sliding_attention", "full_attention"


def _config(kind: str, window: int | None = WINDOW) -> Any:
    if kind == "mistral":
        return transformers.MistralConfig(**SMALL, sliding_window=window)
    if kind == "mixtral":
        return transformers.MixtralConfig(**SMALL, **MOE, sliding_window=window)
    if kind == "qwen2":  # the last two of four layers
        return transformers.Qwen2Config(
            **SMALL, use_sliding_window=True, sliding_window=window, max_window_layers=2
        )
    if kind == "qwen3":
        return transformers.Qwen3Config(
            **SMALL,
            use_sliding_window=True,
            sliding_window=window,
            layer_types=[SLIDING, FULL, SLIDING, FULL],
        )
    return transformers.Qwen3MoeConfig(
        **SMALL,
        use_sliding_window=True,
        sliding_window=window,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )


KINDS = ["mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe"]
WINDOWED = {
    "mistral": {0, 1, 2, 3},
    "mixtral": {0, 1, 2, 3},
    "qwen2": {2, 3},
    "qwen3": {0, 2},
    "qwen3_moe": {0, 1, 2, 3},
}


@pytest.fixture(scope="module", params=KINDS)
def windowed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Any, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, save_random_model(_config(request.param), folder), folder


def test_the_window_applies_to_the_layers_transformers_gives_it(
    windowed: tuple[str, Any, Path],
) -> None:
    kind, model, folder = windowed
    config = load_stage(open_source(folder)).config
    assert (config.sliding_window, set(config.sliding_layers)) == (WINDOW, WINDOWED[kind])
    types = getattr(model.config, "layer_types", None)
    if types:
        assert {i for i, t in enumerate(types) if t == SLIDING} == WINDOWED[kind]


def test_logits_match_transformers_at_once_in_chunks_and_decoding(
    windowed: tuple[str, Any, Path],
) -> None:
    kind, model, folder = windowed
    assert_logits_match(model, folder, chunk=5)
    # the window matters: the same weights with a window longer than the ids give other logits
    ids = random_ids(256)
    full = save_random_model(_config(kind, 64), folder.parent / f"{folder.name}-full")
    assert (
        reference_logits(full, ids) - reference_logits(model, ids)
    ).abs().max().item() > 100 * ATOL


def test_greedy_tokens_match_transformers(windowed: tuple[str, Any, Path]) -> None:
    assert_greedy_matches(*windowed[1:])


def test_a_stage_split_equals_transformers(windowed: tuple[str, Any, Path]) -> None:
    assert_split_matches(*windowed[1:], cuts=(2,))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2"])
def test_a_lockstep_group_equals_one_process(kind: str, tmp_path: Path) -> None:
    """64 greedy tokens after an 8-token prompt: the window slides during decoding."""
    save_random_model(_config(kind), tmp_path)
    assert_group_matches(tmp_path)


def test_batched_sequences_and_a_forked_prefix_equal_each_alone(
    windowed: tuple[str, Any, Path],
) -> None:
    """Three prompts in one batch, then one that begins as the first (its 20 positions, longer
    than the window, are copied from the prefix cache): tokens and logits as each alone."""
    _, _, folder = windowed
    stage = load_stage(open_source(folder))
    base = random_ids(256, 20, seed=4).tolist()
    prompts = [base, random_ids(256, 11, seed=5).tolist(), random_ids(256, 27, seed=6).tolist()]
    params = SamplingParams(max_tokens=16)
    core = EngineCore.local(stage, context_length=128, prefix_cache_bytes=1 << 24)
    batched = [core.scheduler.add(p, params) for p in prompts]
    _run(core)
    forked = core.scheduler.add(base + [3, 4, 5], params)
    rows: list[int] = []
    forward = stage.forward_batch
    stage.forward_batch = lambda inputs, spans, **kw: (
        rows.append(len(inputs)) or forward(inputs, spans, **kw)
    )  # type: ignore[method-assign]
    try:
        logits = _run(core)
    finally:
        del stage.forward_batch
    assert rows[0] < len(forked.prompt), rows  # the prefix's positions came from the cache
    engine = Engine(stage, 128)
    for sequence in (*batched, forked):
        assert sequence.tokens == list(engine.generate(sequence.prompt, params))
    cache = stage.new_cache()
    alone = [stage(torch.tensor(forked.prompt), 0, cache, last_only=True)[-1]]
    for i, token in enumerate(forked.tokens[:-1]):
        alone.append(stage(torch.tensor([token]), len(forked.prompt) + i, cache)[-1])
    assert (torch.stack(logits[forked.id]).float() - torch.stack(alone)).abs().max().item() <= 1e-5


def _run(core: EngineCore) -> dict[int, list[torch.Tensor]]:
    logits: dict[int, list[torch.Tensor]] = {}
    while not core.scheduler.idle:
        for emission in core.step() or ():
            logits.setdefault(emission.sequence.id, []).append(emission.logits)
    return logits


@pytest.mark.parametrize("window", [128, 4096])
def test_a_window_as_long_as_the_context_never_binds(tmp_path: Path, window: int) -> None:
    model = save_random_model(_config("mixtral", window), tmp_path / "hf")
    ids = random_ids(256)
    got = seamline_logits(load_stage(open_source(tmp_path / "hf")), ids)
    assert (got - reference_logits(model, ids)).abs().max().item() < ATOL


def _qwen(cls: Any, **kw: Any) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if cls is transformers.Qwen3MoeConfig:
        extra.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    return dict(cls(**{**SMALL, **extra, **kw}).to_dict())


Q2, Q3, Q3M = transformers.Qwen2Config, transformers.Qwen3Config, transformers.Qwen3MoeConfig
# (config class, use_sliding_window, sliding_window, max_window_layers) over 4 layers
QWEN_CASES = [
    (Q2, False, 16, 0),
    (Q2, True, 16, 2),
    (Q2, True, 16, 4),
    (Q2, True, 128, 0),
    (Q3, True, 16, 3),
    (Q3, False, 16, 0),
    (Q3M, True, 16, None),
    (Q3M, False, 16, None),
]


@pytest.mark.parametrize("cls,use,window,first", QWEN_CASES)
@pytest.mark.parametrize("with_layer_types", [True, False])
def test_qwen_rules_agree_with_transformers(
    cls: Any, use: bool, window: int, first: int | None, with_layer_types: bool
) -> None:
    """The layers a window restricts are those transformers' own config marks sliding."""
    kw: dict[str, Any] = dict(use_sliding_window=use, sliding_window=window)
    if first is not None:
        kw["max_window_layers"] = first
    d = _qwen(cls, **kw)
    config = cls(**{k: v for k, v in d.items() if k != "transformers_version"})
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    applied = config.sliding_window
    marked = {i for i, t in enumerate(types) if t == SLIDING} if applied is not None else set()
    if not with_layer_types:
        d.pop("layer_types", None)  # an older config.json: max_window_layers decides
        if cls is not Q3M:
            d["sliding_window"] = window  # as written before transformers 5
    assert set(sliding_layers(d["model_type"], d)[1]) == marked, d
    assert sliding_window_active(d["model_type"], d) == (bool(marked) and applied < 128), d
    assert set(ModelConfig.from_hf_dict(d).sliding_layers) == marked


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
def test_families_without_a_window_ignore_the_field(model_type: str) -> None:
    assert not sliding_window_active(model_type, {"sliding_window": 4, "use_sliding_window": True})
    assert sliding_layers(model_type, {"sliding_window": 4, "num_hidden_layers": 2}) == (
        0,
        frozenset(),
    )


@pytest.mark.parametrize("kind", ["mixtral", "mistral"])
def test_a_gguf_window_is_carried_and_applied(tmp_path: Path, kind: str) -> None:
    """llama.cpp's {arch}.attention.sliding_window reaches the config (a llama-arch file with
    one reads back as model_type mistral, whose window transformers applies), and the file's
    logits are the folder's."""
    model = save_random_model(_config(kind), tmp_path / "hf")
    path = write_gguf_from_folder(tmp_path / "hf", tmp_path / "m.gguf", "F32")
    d = GGUFSource(path).config_dict()
    assert d["sliding_window"] == WINDOW and d["model_type"] == kind
    ids = random_ids(256)
    got = seamline_logits(load_stage(open_source(path)), ids)
    assert (got - reference_logits(model, ids)).abs().max().item() < ATOL
