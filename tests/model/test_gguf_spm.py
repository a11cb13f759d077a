"""SentencePiece vocabularies in GGUF (``tokenizer.ggml.model`` ``llama``: Llama 1/2, Gemma)
encode as llama.cpp's SPM tokenizer does.

The reference here is that tokenizer's algorithm written out (llama-vocab.cpp's
``llm_tokenizer_spm``): spaces as "▁" (after a leading one where ``add_space_prefix``), the text
as characters, the adjacent pair whose joined text is a token of the highest score merged first
(the leftmost on a tie), again and again; a piece no token covers as its bytes' ``<0xXX>``
tokens. The vocabulary is small and built so that the merge order matters (a high-scoring
token that a greedy longest match would not pick), with control and byte tokens.
"""

from __future__ import annotations

import heapq
from pathlib import Path

import gguf
import pytest

from seamline.weights.gguf import tokenizer_from_gguf

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6
PIECES = {  # token -> score (higher merges first)
    SPACE: -1.0,
    "a": -2.0,
    "b": -2.1,
    "c": -2.2,
    "d": -2.3,
    "h": -2.4,
    "e": -2.5,
    "l": -2.6,
    "o": -2.7,
    "ab": -3.0,
    "bc": -1.5,
    "abc": -4.0,
    "cd": -3.5,
    "he": -5.0,
    "ll": -4.5,
    "llo": -6.0,
    "hello": -7.0,
    SPACE + "h": -8.0,
    SPACE + "hello": -6.5,
    SPACE + "a": -3.2,
    "é": -9.0,
}


def _vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = (
        ["<unk>", "<s>", "</s>", "<start_of_turn>"]
        + [f"<0x{b:02X}>" for b in range(256)]
        + list(PIECES)
    )
    types = [UNKNOWN, CONTROL, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(PIECES)
    scores = [0.0] * 260 + list(PIECES.values())
    return tokens, scores, types


def _write(path: Path, prefix: bool) -> Path:
    tokens, scores, types = _vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_space_prefix(prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def _llama_cpp_spm(text: str, prefix: bool) -> list[int]:
    """llama.cpp's SPM tokenization, as its source computes it."""
    tokens, scores, _ = _vocab()
    ids = {t: i for i, t in enumerate(tokens)}
    symbols = list(((" " + text) if prefix else text).replace(" ", SPACE))
    queue: list[tuple[float, int, str, str]] = []

    def bigram(left: int) -> None:
        if left + 1 < len(symbols) and (joined := symbols[left] + symbols[left + 1]) in ids:
            heapq.heappush(queue, (-scores[ids[joined]], left, symbols[left], symbols[left + 1]))

    for at in range(len(symbols) - 1):
        bigram(at)
    while queue:
        _, left, a, b = heapq.heappop(queue)
        if left + 1 >= len(symbols) or symbols[left] != a or symbols[left + 1] != b:
            continue  # stale: one side merged since
        symbols[left : left + 2] = [a + b]
        queue = [q for q in queue if q[1] < left - 1 or q[1] > left + 1]  # re-pair around the merge
        queue = [(s, at - (1 if at > left else 0), x, y) for s, at, x, y in queue]
        heapq.heapify(queue)
        bigram(left - 1) if left > 0 else None
        bigram(left)
    out: list[int] = []
    for symbol in symbols:
        out += [ids[symbol]] if symbol in ids else [ids[f"<0x{b:02X}>"] for b in symbol.encode()]
    return out


TEXTS = ["hello", "abcd", "abc hello", "hello hello", "ha lle", "héllo wörld", "a", " abc", "x"]


@pytest.mark.parametrize("prefix", [True, False], ids=["space-prefix", "no-prefix"])
def test_a_sentencepiece_vocabulary_encodes_as_llama_cpp_does(tmp_path: Path, prefix: bool) -> None:
    tok = tokenizer_from_gguf(_write(tmp_path / "spm.gguf", prefix))
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False).ids == _llama_cpp_spm(text, prefix), text
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    ids = tok.encode("<start_of_turn>hello", add_special_tokens=False).ids
    assert ids[0] == 3  # a control token is one id
