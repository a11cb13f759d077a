"""The embedded SmolLM2 GGUF: seamline's greedy tokens equal transformers' on the same file."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from seamline.app import LocalModel, default_model_path
from seamline.errors import RequestError
from seamline.params import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of copper, briefly.",
]
TOKENS = 64


@pytest.fixture(scope="module")
def reference() -> Any:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    ref.generation_config.eos_token_id = (
        None  # run all TOKENS steps, as seamline does without stops
    )
    return ref.eval()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_transformers(prompt: str, model: LocalModel, reference: Any) -> None:
    ids = model.codec.encode_chat([{"role": "user", "content": prompt}])
    ours = list(model.engine.generate(ids, SamplingParams(max_tokens=TOKENS)))
    with torch.inference_mode():
        prompt = torch.tensor(
            [ids]
        )  # an explicit mask: the prompt holds pad-id tokens (<|im_end|>)
        out = reference.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=TOKENS, do_sample=False
        )
    theirs = out[0, len(ids) :].tolist()
    assert len(ours) == TOKENS
    assert ours == theirs


def test_answers_paris(model: LocalModel) -> None:
    ids = model.codec.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    params = SamplingParams(max_tokens=32, stop_token_ids=model.codec.stop_ids)
    answer = model.codec.decode(list(model.engine.generate(ids, params)))
    assert "Paris" in answer


def test_stop_token_ends_generation(model: LocalModel) -> None:
    ids = model.codec.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    free = list(model.engine.generate(ids, SamplingParams(max_tokens=12)))
    stopped = list(
        model.engine.generate(ids, SamplingParams(max_tokens=12, stop_token_ids=(free[3],)))
    )
    assert stopped == free[: free.index(free[3])]


def test_seeded_sampling_is_reproducible(model: LocalModel) -> None:
    ids = model.codec.encode_chat([{"role": "user", "content": PROMPTS[1]}])
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=123, max_tokens=24)
    first = list(model.engine.generate(ids, params))
    assert first == list(model.engine.generate(ids, params))
    other = list(
        model.engine.generate(ids, SamplingParams(temperature=1.0, seed=124, max_tokens=24))
    )
    assert other != first


def test_prompt_longer_than_context_is_refused(model: LocalModel) -> None:
    ids = [1] * (model.engine.context_length + 1)
    with pytest.raises(RequestError, match="context is"):
        list(model.engine.generate(ids, SamplingParams(max_tokens=4)))


def test_chunked_prefill_equals_one_pass(model: LocalModel) -> None:
    from seamline.runtime import engine as engine_module

    ids = model.codec.encode("the quick brown fox jumps over the lazy dog " * 8)
    whole = model.engine.prefill(ids, model.engine.stage.new_cache())
    old = engine_module.PREFILL_CHUNK
    engine_module.PREFILL_CHUNK = 7
    try:
        chunked = model.engine.prefill(ids, model.engine.stage.new_cache())
    finally:
        engine_module.PREFILL_CHUNK = old
    # chunks of 7 rows go through the quantized decode kernel, the whole prompt through the
    # float32 GEMM on dequantised weights: the same float32 products summed in another order
    # (measured 1.7e-4 at logits of ~38, 4e-6 relative); a wrong position or cache is O(1)
    torch.testing.assert_close(chunked, whole, atol=1e-3, rtol=0)
