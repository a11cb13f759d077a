"""A multimodal Gemma 3 folder (``model_type`` ``gemma3``: 4B, 12B, 27B) read as its text model.

Its config.json keeps the text model's fields under ``text_config``; its tensors are the
language model's (``language_model.model.*`` as published, ``model.language_model.*`` as
transformers names them in memory), a vision tower and a projector, which seamline, serving
text, leaves out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
TOP_FIELDS = (
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
)  # beside text_config in some files


def gemma3_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    text = dict(raw.get("text_config") or {})
    for key in TOP_FIELDS:
        if key not in text and key in raw:
            text[key] = raw[key]
    text["model_type"] = "gemma3_text"
    return text


def gemma3_text_names(files: dict[str, Path]) -> tuple[dict[str, str], dict[str, Path]]:
    """(our name -> the file's, the text model's tensors under our names)."""
    spelling: dict[str, str] = {}
    listed: dict[str, Path] = {}
    for name, path in files.items():
        for theirs, ours in TEXT_PREFIXES.items():
            if name.startswith(theirs):
                one = ours + name.removeprefix(theirs)
                spelling[one], listed[one] = name, path
    return spelling, listed
