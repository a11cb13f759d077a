"""llama.cpp's vocabulary-only GGUF files (``models/ggml-vocab-*.gguf``), and copies of them
with some keys changed or taken out: a prompt's BOS and EOS are decided by those keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from tests.support.llama_cpp import llama_cpp_source

ABSENT = object()  # an override that takes the key out


def vocab_file(name: str) -> Path:
    """``models/ggml-vocab-NAME.gguf`` of llama.cpp's source."""
    return llama_cpp_source() / "models" / f"ggml-vocab-{name}.gguf"


def vocab_copy(name: str, out: Path, overrides: dict[str, Any]) -> Path:
    """A copy of vocabulary ``name``'s file with ``overrides`` (key -> a new value, or
    ``ABSENT``); a new key takes the type of its Python value (bool, int, str)."""
    reader = gguf.GGUFReader(vocab_file(name))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in overrides:
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for key, value in overrides.items():
        if value is ABSENT:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, str(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
