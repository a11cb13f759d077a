"""DeepSeek-V4 split by layer range over a 2-node mesh (real processes, real sockets) equals
the single process: the frames between the stages carry the residual [tokens, 4, hidden] and
the tokens' ids, which the second stage's hash-routed layer reads."""

from __future__ import annotations

from pathlib import Path

from seamline.app import LocalModel
from seamline.params import SamplingParams
from tests.mesh_harness import split_completion
from tests.v4_reference import save_random_v4, v4_config, with_tokenizer

CONTEXT = 256
PROMPT = "The rivers of Europe include"


def build_v4_folder(folder: Path) -> Path:
    """A random 4-layer V4 (a hash-routed layer in each half) with the embedded tokenizer."""
    from seamline.app import default_model_path
    from seamline.weights.gguf import tokenizer_from_gguf

    vocab = tokenizer_from_gguf(default_model_path()).get_vocab_size()
    config = v4_config(vocab=vocab, layers=4, mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"],
                       max_position_embeddings=CONTEXT)  # fmt: skip
    save_random_v4(folder, config)
    return with_tokenizer(folder)


def test_v4_mesh_of_two_stages_matches_single_process(tmp_path: Path) -> None:
    folder = build_v4_folder(tmp_path / "v4")
    local = LocalModel.load(folder, context=CONTEXT)
    ids = local.codec.encode(PROMPT)
    tokens = list(local.engine.generate(ids, SamplingParams(max_tokens=24)))
    assert len(tokens) == 24 and len(set(tokens)) > 1  # a run long enough to cross windows, not one token
    expected = local.codec.decode(tokens)
    assert split_completion(tmp_path / "mesh", folder, PROMPT, 24, CONTEXT) == expected
