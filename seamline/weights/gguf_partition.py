"""A GGUF file's text to ids as llama.cpp makes them: first the text is cut at the tokens it
matches whole (``tokenizer_st_partition``), then each stretch of raw text between them is
tokenized alone.

The cut goes token by token, longest text first (llama.cpp sorts them by length in bytes), each
splitting every stretch of raw text still left; so where two overlap, the longer wins, wherever
it starts. CONTROL and UNKNOWN tokens are matched only when special tokens are parsed,
USER_DEFINED ones always. A token that strips whitespace beside it strips C's ``isspace`` only
(ASCII), never U+00A0 or U+3000. The stretches are what a SentencePiece vocabulary's
``add_space_prefix`` applies to: each one follows a token or starts the text, so each gets its "▁".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import Tokenizer

ASCII_SPACE = " \t\n\v\f\r"  # C's isspace in the C locale: what llama.cpp strips
Fragment = str | int  # raw text, or the id of a token matched whole
PREFIX = 8  # characters a group of tokens shares


@dataclass(frozen=True)
class Whole:
    """A token llama.cpp matches whole in the text."""

    text: str
    id: int
    special: bool  # matched only when special tokens are parsed (CONTROL, UNKNOWN)
    lstrip: bool = False  # whitespace left of it is dropped
    rstrip: bool = False  # whitespace right of it is dropped


class Partition:
    """llama.cpp's split of a text at the tokens it matches whole."""

    def __init__(self, tokens: Iterable[Whole]) -> None:
        # longest first; llama.cpp's sort leaves equal lengths in no set order: here by id.
        # An empty text would match everywhere (llama.cpp's loop never ends on one): left out
        self.tokens = sorted(
            (t for t in tokens if t.text), key=lambda t: (-len(t.text.encode()), t.id)
        )
        # grouped by their first characters, so that one search rules out a group: a search of
        # a long text for each of Gemma's 6414 tokens alone took ten times its tokenizing
        self._groups: dict[str, list[Whole]] = {}
        for token in self.tokens:
            self._groups.setdefault(token.text[:PREFIX], []).append(token)

    @classmethod
    def of_tokenizer(cls, tok: Tokenizer) -> Partition:
        """The added tokens of a tokenizer built from a GGUF file (``gguf_special.py``)."""
        added = tok.get_added_tokens_decoder().items()
        return cls(Whole(a.content, i, a.special, a.lstrip, a.rstrip) for i, a in added)

    def split(self, text: str, parse_special: bool) -> list[Fragment]:
        """``text`` as raw stretches and token ids, in order; no stretch is empty."""
        parts: list[Fragment] = [text] if text else []
        for token in self._present(text):
            if parse_special or not token.special:
                parts = [piece for part in parts for piece in _cut(part, token)]
        return parts

    def _present(self, text: str) -> list[Whole]:
        """The tokens found in the whole text, longest first: no other is in any stretch of it."""
        found = {
            token.id
            for prefix, group in self._groups.items()
            if prefix in text
            for token in group
            if token.text in text
        }
        return [token for token in self.tokens if token.id in found]


def _cut(part: Fragment, token: Whole) -> list[Fragment]:
    """``part`` cut at each occurrence of ``token``, left to right, stripping beside it."""
    if isinstance(part, int) or token.text not in part:
        return [part]
    out: list[Fragment] = []
    start = 0
    while (at := part.find(token.text, start)) >= 0:
        left = part[start:at]
        if token.lstrip:
            left = left.rstrip(ASCII_SPACE)
        if left:
            out.append(left)
        out.append(token.id)
        start = at + len(token.text)
        while token.rstrip and start < len(part) and part[start] in ASCII_SPACE:
            start += 1
    if start < len(part):
        out.append(part[start:])
    return out


class GGUFText:
    """Text to ids for a tokenizer built from a GGUF file, through llama.cpp's partition.

    It takes the tokenizer over: the tokenizer's own matching of special added tokens is turned
    off, once, here (set while another thread encodes, ``tokenizers`` refuses). In a raw stretch
    none is left to match anyway: the partition took out every USER_DEFINED token, and the
    CONTROL ones it leaves (special tokens not parsed) are special added tokens."""

    def __init__(self, tok: Tokenizer) -> None:
        tok.encode_special_tokens = True
        self.tokenizer = tok
        self.partition = Partition.of_tokenizer(tok)

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """The text's ids, nothing added around them; ``parse_special``: CONTROL and UNKNOWN
        tokens written in the text are matched (llama.cpp's parse_special)."""
        parts = self.partition.split(text, parse_special)
        raw = [part for part in parts if isinstance(part, str)]
        # a batch lets go of the GIL while it runs
        encoded = iter(self.tokenizer.encode_batch(raw, add_special_tokens=False) if raw else [])
        ids: list[int] = []
        for part in parts:
            if isinstance(part, int):
                ids.append(part)
            else:
                ids += next(encoded).ids
        return ids
