"""The GGUF files `bench gpu` and the CUDA tests run: random weights of the embedded model's
shapes (SmolLM2-135M in Q4_1 with a Q8_0 tied head, as the embedded file) and of `bench quant`'s
1.1B in Q4_K_M, written once and cached. A device machine gets the project's files but not the
98 MB embedded file; the tokenizer comes from the embedded file where it is installed, else from
``SEAMLINE_TOKENIZER_GGUF`` (a GGUF holding at least its ``tokenizer.*`` metadata)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from seamline_bench.quant import LLAMA_1B, RandomLlama, llama_1b_path

TOKENIZER_ENV = "SEAMLINE_TOKENIZER_GGUF"
SMOL_135M: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}  # SmolLM2-135M-Instruct's shape


class TiedRandomLlama(RandomLlama):
    """``RandomLlama`` with the head tied to the embedding (no ``lm_head``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.shapes.pop("lm_head.weight")


def tokenizer_gguf() -> Path:
    """A GGUF with the embedded model's tokenizer."""
    given = os.environ.get(TOKENIZER_ENV)
    if given:
        return Path(given)
    from seamline.app import default_model_path

    return default_model_path()


def cache_root() -> Path:
    return Path(os.environ.get("SEAMLINE_CACHE", Path.home() / ".cache" / "seamline")) / "bench"


def embedded_shaped_path(root: Path | None = None) -> Path:
    """Random weights in the embedded model's shapes and types (Q4_1, tied Q8_0 head)."""
    from seamline.weights.gguf_write import write_gguf

    root = root or cache_root()
    path = root / "smol_135m_random_q4_1.gguf"
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_gguf(
            partial,
            SMOL_135M,
            TiedRandomLlama(SMOL_135M),
            "Q4_1",
            tokenizer_from=tokenizer_gguf(),
            name="random-smol-135m",
        )
        partial.rename(path)
    return path


def gpu_models(root: Path | None = None) -> dict[str, Path]:
    """The bench's two files by name (the 1.1B from `bench quant`'s cache when it is there)."""
    return {
        "embedded": embedded_shaped_path(root),
        "llama_1b": llama_1b_path(root, tokenizer_gguf()),
    }


__all__ = ["LLAMA_1B", "SMOL_135M", "gpu_models", "embedded_shaped_path", "tokenizer_gguf"]
