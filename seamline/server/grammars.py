"""The grammars a chat request's output must match, compiled and checked before any work:
``response_format`` (``json_object``, ``json_schema``) and a required tool call's shape
(server/tools.py). A grammar llguidance cannot compile is a 400 naming the field, and so is
one over ``MAX_GRAMMAR_BYTES`` (it travels to the nodes with every request: ``SamplingParams``).

JSON is generated compact (no free whitespace): a schema with bounded lengths then has a
bounded answer, which ends with the request's stop token once the grammar is complete.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from llguidance import LLMatcher, LLTokenizer

from seamline.params import MAX_GRAMMAR_BYTES
from seamline.runtime.grammar import compile_check
from seamline.server.openai_schema import ResponseFormat, bad_request
from seamline.text import TextCodec

COMPACT = {"whitespace_flexible": False}  # llguidance's JSON options


def compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with llguidance's compact JSON options (for a schema inlined in Lark)."""
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **COMPACT}}


class GrammarCheck:
    """Compiles grammars against the served tokenizer (built once, on the first grammar)."""

    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec
        self._tokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()

    def check(self, grammar: str, param: str, what: str, size_param: str | None = None) -> str:
        """``grammar`` when it compiles; a 400 naming ``param`` when it does not, or
        ``size_param`` (default ``param``) when it is too large (checked first: no compile)."""
        size = len(grammar.encode())
        if size > MAX_GRAMMAR_BYTES:
            raise bad_request(
                f"{what} makes a grammar of {size} bytes; at most {MAX_GRAMMAR_BYTES} are taken",
                size_param or param,
                "grammar_too_large",
            )
        error = compile_check(grammar, self.tokenizer())
        if error:
            raise bad_request(
                f"{what} cannot be compiled into a grammar: {error}", param, "invalid_grammar"
            )
        return grammar

    def json_schema(self, schema: dict[str, Any], param: str, what: str = "the JSON schema") -> str:
        try:
            grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=COMPACT)
        except (ValueError, TypeError) as exc:
            raise bad_request(
                f"{what} is not a JSON schema: {exc}", param, "invalid_grammar"
            ) from None
        return self.check(grammar, param, what)

    def response_format(self, fmt: ResponseFormat | None) -> str:
        """The grammar of ``response_format``; "" for text."""
        if fmt is None or fmt.type == "text":
            return ""
        if fmt.type == "json_object":
            return self.json_schema({"type": "object"}, "response_format")
        assert fmt.json_schema is not None
        return self.json_schema(fmt.json_schema.schema_ or {}, "response_format.json_schema.schema")

    def special_tokens(self) -> dict[str, int]:
        """The served tokenizer's special tokens (a grammar names them by id)."""
        return self._codec.special_tokens()

    def tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = LLTokenizer(self._codec.tokenizer.to_str())
            return self._tokenizer
