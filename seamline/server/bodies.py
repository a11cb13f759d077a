"""Request bodies parsed, and prompts tokenised, without stalling the server's event loop and
within bounded memory, however large the body (up to the body cap) or long the prompt.

- A body over ``LARGE_BODY_BYTES`` is parsed in a worker thread, and its prompt rendered and
  tokenised there too, holding one of ``LARGE_SLOTS`` permits (``LargeBodies``): however many
  large bodies arrive, that many at a time are expanded into Python objects and tokens.
- A long prompt is counted a piece at a time (``encode_within``): once it surely has more
  tokens than the server takes, it is refused after tokenising about that many, not all of
  it (a 15 MB prompt took ~20 s and 1.4 GB to tokenise whole). The tokenizer lets go of the
  GIL while it works, so the event loop goes on meanwhile.
- The rules are FastAPI's own (``parse_body``): JSON only with a JSON content type, and the
  same OpenAI-style 400s (``openai_schema.validation_error``).
"""

from __future__ import annotations

import asyncio
import email.message
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio
from pydantic import BaseModel, ValidationError

from seamline.server.openai_schema import bad_request, validation_error
from seamline.text import TextCodec

LARGE_BODY_BYTES = 1 << 20  # a body parsed in place below this takes ~1 ms of the event loop
LARGE_SLOTS = (
    1  # large bodies expanded at once: parsing and tokenising cost tens of times a body's size
)
PIECE_CHARS = (
    1 << 16
)  # a long prompt is tokenised this many characters at a time while it is counted
CUT_WINDOW = 1 << 10  # a piece ends where a word begins, looked for this far back
CUT_SLACK = 16  # tokens a cut may add to a count (the pieces' tokens against the whole's)

M = TypeVar("M", bound=BaseModel)


def parse_body(raw: bytes, content_type: str | None, model: type[M]) -> M:
    """``raw`` as ``model``; the 400 FastAPI's parsing gives where it is not one."""
    if not raw:
        raise bad_request("the request body must be a JSON object", None, "invalid_body")
    if not _is_json(content_type):  # no CORS preflight for other types: see openai_api.create_app
        raise bad_request(
            "the request body must be JSON, sent with Content-Type: application/json",
            None,
            "invalid_body",
        )
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(list(exc.errors(include_url=False))) from None


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


class LargeBodies:
    """The permits of large bodies being expanded (parsed, rendered, tokenised)."""

    def __init__(self, slots: int = LARGE_SLOTS) -> None:
        self._slots = asyncio.Semaphore(slots)

    @asynccontextmanager
    async def expanding(self, raw: bytes) -> AsyncIterator[None]:
        """Held while a request's body becomes its prompt; a large body waits for a permit."""
        if len(raw) <= LARGE_BODY_BYTES:
            yield
            return
        async with self._slots:
            yield

    async def parse(self, raw: bytes, content_type: str | None, model: type[M]) -> M:
        """``parse_body``, in a worker thread for a large body (inside ``expanding``)."""
        if len(raw) <= LARGE_BODY_BYTES:
            return parse_body(raw, content_type, model)
        return await anyio.to_thread.run_sync(parse_body, raw, content_type, model)


def encode_within(codec: TextCodec, text: str, most: int) -> list[int] | None:
    """``text``'s token ids (``codec.encode``'s), or None when it surely has more than ``most``.

    A text longer than a piece is counted piece by piece and given up once the count passes
    ``most`` by more than the cuts could have added; only a text that may fit is tokenised
    whole (at most about ``most`` tokens' worth of text, plus a piece)."""
    if len(text) <= PIECE_CHARS:
        return codec.encode(text)
    counted, start, cuts = 0, 0, 0
    while start < len(text):
        end = _word_start(text, start + PIECE_CHARS)
        counted += len(codec.encode(text[start:end]))
        start, cuts = end, cuts + 1
        if counted > most + CUT_SLACK * cuts:
            return None
    return codec.encode(text)


def _word_start(text: str, at: int) -> int:
    """Where a piece that may end at ``at`` ends: before the last whitespace in the window (a
    word's leading space stays with its word, as the tokenizer's pre-tokenizer has it), or at
    ``at`` when the window holds none."""
    if at >= len(text):
        return len(text)
    space = max(text.rfind(" ", at - CUT_WINDOW, at), text.rfind("\n", at - CUT_WINDOW, at))
    return space if space > 0 else at
