"""A tiny random Llama folder with a tokenizer, and what tests do with its fragment package."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from seamline.weights.fragments import FragmentEntry, Manifest, fragments_for
from tests.support.reference import save_random_model

TOKEN = "s3cret"  # the fragment server's token in these tests
LAYERS = 4
SMALL: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def build_tiny(folder: Path) -> Path:
    """The tiny Llama (random weights) with a word-level tokenizer and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig

    save_random_model(LlamaConfig(**SMALL, tie_word_embeddings=False), folder)
    vocab = {f"w{i}": i for i in range(SMALL["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
        "bos_token": "w1",
        "eos_token": "w2",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def subset(package_dir: Path, manifest: Manifest, entries: list[FragmentEntry], dest: Path) -> Path:
    """A node's folder: the manifest plus only these fragment files."""
    dest.mkdir()
    for entry in entries:
        shutil.copyfile(package_dir / entry.file, dest / entry.file)
    manifest.save(dest)
    return dest


def fragment_range(manifest: Manifest, start: int, end: int) -> list[FragmentEntry]:
    """The fragments a stage of layers [start, end) loads."""
    return fragments_for(manifest, (start, end), start == 0, end == manifest.num_layers)
