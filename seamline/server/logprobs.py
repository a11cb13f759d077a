"""Log-probabilities in OpenAI's two shapes: chat's ``{"content": [{token, logprob, bytes,
top_logprobs}]}`` and text completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``.
A token's text is its own decoding (a piece of a character's bytes shows as U+FFFD; ``bytes``
are the UTF-8 of that text)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from seamline.runtime.sampling import TokenEvent
from seamline.text import TextCodec


def token_text(codec: TextCodec, token: int) -> str:
    return codec.decode_partial([token], special=True)


def chat_logprobs(codec: TextCodec, tokens: Sequence[TokenEvent]) -> dict[str, Any]:
    def entry(token: int, logprob: float | None) -> dict[str, Any]:
        text = token_text(codec, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
            for t in tokens
        ]
    }


def completion_logprobs(
    codec: TextCodec, tokens: Sequence[TokenEvent], offset: int
) -> dict[str, Any]:
    """``offset``: where the first token's text starts in the choice's text."""
    texts = [token_text(codec, t.token) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{token_text(codec, i): lp for i, lp in t.top} for t in tokens],
        "text_offset": offsets,
    }
