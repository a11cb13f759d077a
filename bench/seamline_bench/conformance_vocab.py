"""llama.cpp's vocabulary vectors through seamline's tokenizers: every ``.inp`` line of
``models/ggml-vocab-NAME.gguf`` encoded (no BOS or EOS, special tokens not parsed, as
llama.cpp's ``tests/test-tokenizer-0.cpp`` encodes them) and held to its ``.out`` ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from seamline.errors import SeamlineError
from seamline_bench.references import llama_cpp_source

VOCABS = (
    "llama-spm",
    "llama-bpe",
    "qwen2",
    "qwen35",
    "deepseek-llm",
    "deepseek-coder",
    "gpt-2",
    "phi-3",
    "gemma-4",
    "falcon",
    "starcoder",
    "refact",
    "command-r",
    "mpt",
)
SEPARATOR = "\n__ggml_vocab_test__\n"


def read_vectors(vocab: Path) -> list[tuple[str, list[int]]]:
    """The inputs and expected ids, read as test-tokenizer-0.cpp reads them (bytes, no newline
    translation: some inputs hold "\\r")."""
    raw = vocab.with_name(vocab.name + ".inp").read_bytes().decode("utf-8")
    inputs = raw.split(SEPARATOR)
    if raw.endswith(SEPARATOR):
        inputs.pop()  # the separator closes the last input
    out = vocab.with_name(vocab.name + ".out").read_bytes().decode("utf-8")
    lines = out.split("\n")[:-1] if out.endswith("\n") else out.split("\n")
    if len(inputs) != len(lines):
        raise ValueError(f"{vocab.name}: {len(inputs)} inputs, {len(lines)} outputs")
    return [(text, [int(t) for t in line.split()]) for text, line in zip(inputs, lines)]


def vocab_path(name: str) -> Path:
    return llama_cpp_source() / "models" / f"ggml-vocab-{name}.gguf"


def vocab_failures(name: str, tok: Tokenizer | None = None) -> tuple[int, list[str]]:
    """How many vectors vocabulary ``name`` has, and a line for each one seamline misses;
    ``tok``: the tokenizer to hold to them (default: the one seamline builds from the file)."""
    from seamline.weights.gguf_partition import GGUFText
    from seamline.weights.gguf_tokenizer import tokenizer_from_gguf

    path = vocab_path(name)
    vectors = read_vectors(path)
    encoder = GGUFText(tok if tok is not None else tokenizer_from_gguf(path))
    failed = []
    for text, want in vectors:
        got = encoder.encode(text, parse_special=False)
        if got != want:
            failed.append(f"{name}: {text!r}: llama.cpp {want}, seamline {got}")
    return len(vectors), failed


def vocab_vectors() -> dict[str, Any]:
    """Per vocabulary: vectors passed and failed; all the failed lines."""
    per: dict[str, Any] = {}
    lines: list[str] = []
    for name in VOCABS:
        try:
            count, failed = vocab_failures(name)
        except (SeamlineError, ValueError, OSError) as exc:  # a vocabulary refused fails whole
            per[name] = {"passed": 0, "failed": None, "error": f"{type(exc).__name__}: {exc}"}
            continue
        per[name] = {"passed": count - len(failed), "failed": len(failed)}
        lines += failed
    passed = sum(v["passed"] for v in per.values())
    return {"passed": passed, "failed": len(lines), "failed_lines": lines, "per_vocab": per}
