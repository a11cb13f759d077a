"""GGUF vocabularies encode exactly as llama.cpp does: every vector llama.cpp ships beside its
``models/ggml-vocab-*.gguf`` files (``tests/test-tokenizer-0.cpp``: no BOS/EOS, control tokens
not parsed), llama.cpp's own Unicode classes, and one-line refusals of what seamline cannot
encode."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import pytest

from seamline.errors import CheckpointError
from seamline.weights.gguf_file import GGUFFile
from seamline.weights.gguf_tokenizer import check_tokenizer, tokenizer_from_gguf
from seamline.weights.gguf_unicode import RANGES, WHITESPACE
from tests.support.llama_cpp import llama_cpp_source

VOCABS = (
    "llama-spm", "llama-bpe", "qwen2", "qwen35", "deepseek-llm", "deepseek-coder", "gpt-2",
    "phi-3", "gemma-4", "falcon", "starcoder", "refact", "command-r", "mpt",
)  # fmt: skip
SEPARATOR = "\n__ggml_vocab_test__\n"


@cache
def _source() -> Path:
    return llama_cpp_source()


def read_vectors(vocab: Path) -> list[tuple[str, list[int]]]:
    """The inputs and expected ids, read as test-tokenizer-0.cpp reads them (bytes, no newline
    translation: some inputs hold "\\r")."""
    raw = vocab.with_name(vocab.name + ".inp").read_bytes().decode("utf-8")
    inputs, pos = [], 0
    while pos < len(raw):
        end = raw.find(SEPARATOR, pos)
        if end < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:end])
        pos = end + len(SEPARATOR)
    out = vocab.with_name(vocab.name + ".out").read_bytes().decode("utf-8")
    lines = out.split("\n")[:-1] if out.endswith("\n") else out.split("\n")
    assert len(inputs) == len(lines), f"{vocab.name}: {len(inputs)} inputs, {len(lines)} outputs"
    return [(text, [int(t) for t in line.split()]) for text, line in zip(inputs, lines)]


@pytest.mark.parametrize("name", VOCABS)
def test_vocab_vectors(name: str) -> None:
    path = _source() / "models" / f"ggml-vocab-{name}.gguf"
    vectors = read_vectors(path)
    tok = tokenizer_from_gguf(path)
    tok.encode_special_tokens = True  # llama.cpp's parse_special=false
    wrong = []
    for text, want in vectors:
        got = tok.encode(text, add_special_tokens=False).ids
        if got != want:
            wrong.append(f"  {text!r}: llama.cpp {want}, seamline {got}")
    assert not wrong, f"{name}: {len(wrong)} of {len(vectors)} vectors differ\n" + "\n".join(
        wrong[:20]
    )


def _llama_categories() -> tuple[dict[str, list[tuple[int, int]]], list[int]]:
    """llama.cpp's codepoint ranges per category, and its whitespace, from unicode-data.cpp."""
    text = (_source() / "src" / "unicode-data.cpp").read_text(encoding="utf-8")
    body = text.split("unicode_ranges_flags = {")[1].split("};")[0]
    flags = [(int(a, 16), int(b, 16)) for a, b in re.findall(r"\{0x(\w+), 0x(\w+)\}", body)]
    names = {0x02: "N", 0x04: "L", 0x10: "M", 0x20: "P", 0x40: "S"}
    ranges: dict[str, list[tuple[int, int]]] = {name: [] for name in names.values()}
    for (first, flag), (end, _) in zip(flags, flags[1:]):
        if (name := names.get(flag & 0xFF)) is None:
            continue
        if ranges[name] and ranges[name][-1][1] == first - 1:
            ranges[name][-1] = (ranges[name][-1][0], end - 1)
        else:
            ranges[name].append((first, end - 1))
    ws = text.split("unicode_set_whitespace = {")[1].split("};")[0]
    return ranges, sorted(int(c, 16) for c in re.findall(r"0x(\w+)", ws))


def test_unicode_classes_are_llama_cpps() -> None:
    ranges, whitespace = _llama_categories()
    for name, expected in ranges.items():
        ours = []
        for item in RANGES[name].split():
            first, _, last = item.partition("-")
            ours.append((int(first, 16), int(last or first, 16)))
        assert ours == expected, f"\\p{{{name}}} differs from llama.cpp's unicode-data.cpp"
    assert [int(c, 16) for c in WHITESPACE.split()] == whitespace


def _write(path: Path, meta: dict[str, Any]) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        if isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("model", "pre", "key", "value"),
    [
        ("ugm", None, "tokenizer.ggml.model", "ugm"),
        ("rwkv", None, "tokenizer.ggml.model", "rwkv"),
        ("bert", None, "tokenizer.ggml.model", "bert"),
        ("t5", None, "tokenizer.ggml.model", "t5"),
        ("gpt2", "mystery", "tokenizer.ggml.pre", "mystery"),
        ("gpt2", None, "tokenizer.ggml.pre", None),
    ],
)
def test_unsupported_tokenizers_are_refused(
    tmp_path: Path, model: str, pre: str | None, key: str, value: str | None
) -> None:
    """Refused from the metadata alone (no tokens, merges or weights read), in one line naming
    the file, the key and its value."""
    meta = {"tokenizer.ggml.model": model, **({"tokenizer.ggml.pre": pre} if pre else {})}
    path = _write(tmp_path / f"{model}-{pre}.gguf", meta)
    for refuse in (lambda: check_tokenizer(GGUFFile.open(path)), lambda: tokenizer_from_gguf(path)):
        with pytest.raises(CheckpointError) as caught:
            refuse()
        message = str(caught.value)
        assert "\n" not in message, message
        assert str(path) in message and key in message and repr(value) in message, message


def test_supported_tokenizer_models_pass_the_check(tmp_path: Path) -> None:
    for model, pre in (("llama", None), ("gemma4", None), ("gpt2", "qwen35"), ("gpt2", "falcon")):
        meta = {"tokenizer.ggml.model": model, **({"tokenizer.ggml.pre": pre} if pre else {})}
        assert check_tokenizer(GGUFFile.open(_write(tmp_path / f"{model}.gguf", meta))) == model
