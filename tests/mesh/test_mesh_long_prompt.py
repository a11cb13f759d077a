"""A long prompt crosses a mesh in chunks: the coordinator sends a prompt to stage 0 in chunks
of 32,768 tokens (one control frame would not hold a prompt near a 160k context: that bound is
checked without a model in test_stage_batches.py), stage 0 runs it once the last has come, and
the split answers as the single process does.

A tiny random Llama with a 40k context and the embedded model's vocabulary; a prompt of more
than 32,768 tokens (two chunks) through a 2-stage mesh over loopback.
"""

from __future__ import annotations

import json
from pathlib import Path

from seamline.app import LocalModel, default_model_path
from seamline.net.messages import PROMPT_CHUNK_TOKENS
from seamline.params import SamplingParams
from seamline.weights.gguf import tokenizer_from_gguf
from tests.support.mesh_harness import split_completion
from tests.support.reference import save_random_model

CONTEXT = 40960
WORDS = (
    "river",
    "stone",
    "cloud",
    "amber",
    "quiet",
    "north",
    "lantern",
    "meadow",
    "copper",
    "harbor",
)


def _long_context_folder(folder: Path) -> Path:
    from transformers import LlamaConfig

    tokenizer = tokenizer_from_gguf(default_model_path())
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
    )
    save_random_model(config, folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({}))
    return folder


def test_a_prompt_longer_than_one_control_frame_is_served_as_the_single_process_serves_it(
    tmp_path: Path,
) -> None:
    folder = _long_context_folder(tmp_path / "long")
    local = LocalModel.load(folder, context=CONTEXT)
    prompt = " ".join(WORDS[(i * 7) % len(WORDS)] + str(i % 97) for i in range(12000))
    ids = local.codec.encode(prompt)
    assert PROMPT_CHUNK_TOKENS < len(ids) < CONTEXT - 64  # two chunks
    expected = local.codec.decode(list(local.engine.generate(ids, SamplingParams(max_tokens=8))))
    assert split_completion(tmp_path / "mesh", folder, prompt, 8, CONTEXT) == expected
