"""The grammar of a required tool call (``tool_choice`` "required" or a named function), in
each family's format (``server/tool_formats.py``), as Lark for llguidance: the call's markers
and name as written, its JSON arguments by the tool's schema, and for the XML-style families
(Qwen3-Coder, GLM, DSML) each parameter in the schema's order (the required ones always), a
string's value as text up to the next tag and any other value as JSON by its schema.

A marker that is a special token of the tokenizer is named as that token (``lark_text``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from seamline.server.grammars import compact_schema
from seamline.server.reasoning import CLOSE as THINK_CLOSE
from seamline.server.tool_formats import ToolFormat

Literal = Callable[[str], str]  # text -> Lark items that match it exactly
_REGEX_META = set("\\.+*?()|[]{}^$")


def lark_text(text: str, specials: Mapping[str, int]) -> str:
    """``text`` as Lark items: string literals (JSON's escapes; the markers' own characters
    kept), and a special token of the tokenizer as that token (``<[id]>``): a special token
    is never spelled by other tokens, so the grammar must name it."""
    if not specials:
        return json.dumps(text, ensure_ascii=False)
    split = re.compile(
        "(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
    )
    items = [
        f"<[{specials[part]}]>" if part in specials else json.dumps(part, ensure_ascii=False)
        for part in split.split(text)
        if part
    ]
    return " ".join(items)


def _json_rule(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(compact_schema(schema))


def _regex_text(text: str) -> str:
    """``text`` matched literally inside a Lark ``/.../`` regex."""
    out = "".join("\\" + c if c in _REGEX_META else c for c in text)
    return out.replace("\n", "\\n").replace("/", "\\/")


class Rules:
    """The Lark rules of one grammar, named as they are added."""

    def __init__(self, lit: Literal) -> None:
        self.lit = lit
        self.lines: list[str] = []

    def add(self, name: str, body: str) -> str:
        self.lines.append(f"{name}: {body}")
        return name

    def json(self, name: str, schema: dict[str, Any]) -> str:
        return self.add(name, _json_rule(schema))

    def text_until(self, name: str, close: str, schema: dict[str, Any]) -> str:
        """A string value, then ``close``: one of the schema's ``enum``, or text with no ``<``
        (at most its ``maxLength``); one lexeme with ``close`` where that is plain text (a
        lexeme cannot end inside a longer possible match), else the text, then it."""
        closing = self.lit(close)
        if isinstance(schema.get("enum"), list):
            texts = [v for v in schema["enum"] if isinstance(v, str)]
            return self.add(name, " | ".join(self.lit(v + close) for v in texts) or closing)
        most = schema.get("maxLength")
        text = f"[^<]{{0,{int(most)}}}" if isinstance(most, int) else "[^<]*"
        if closing == json.dumps(close, ensure_ascii=False):
            return self.add(name, f"/{text}{_regex_text(close)}/")
        return self.add(name, f"/{text}/ {closing}")


def _is_string(schema: dict[str, Any]) -> bool:
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and "type" not in schema:
        return all(isinstance(v, str) for v in enum)
    return schema.get("type") == "string"


def _xml_params(rules: Rules, prefix: str, schema: dict[str, Any], param: tuple[str, str]) -> str:
    """An XML-style call's parameters, in the schema's order (the optional ones optional):
    ``param`` is a parameter's opening and the text that closes its value."""
    opening, close = param
    props: dict[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    items = []
    for j, (key, sub) in enumerate(props.items()):
        sub = sub if isinstance(sub, dict) else {}
        if _is_string(sub):
            value = rules.text_until(f"{prefix}_v{j}", close, sub)
        else:
            value = f"{rules.json(f'{prefix}_j{j}', sub)} {rules.lit(close)}"
        head = opening.replace("{key}", key).replace(
            "{string}", "true" if _is_string(sub) else "false"
        )
        item = f"{rules.lit(head)} {value}"
        items.append(item if key in required else f"({item})?")
    return " ".join(items) if items else '""'


def _text(rules: Rules, text: str, name: str) -> str:
    """``text`` with the tool's name in it, and ``{id}`` as a call id (9 letters and digits)."""
    text = text.replace("{qname}", json.dumps(name, ensure_ascii=False)).replace("{name}", name)
    items: list[str] = []
    for k, part in enumerate(text.split("{id}")):
        items += (["/[a-zA-Z0-9]{9}/"] if k else []) + ([rules.lit(part)] if part else [])
    return " ".join(items)


def call_rule(fmt: ToolFormat, rules: Rules, i: int, name: str, schema: dict[str, Any]) -> str:
    """Adds the rules of a call of ``name`` to ``rules``; the name of its rule."""
    shape = fmt.shape
    if shape.param is not None:
        arguments = _xml_params(rules, f"p{i}", schema, shape.param)
    else:
        arguments = rules.json(f"args_{i}", schema)
    tail = f" {_text(rules, shape.tail, name)}" if shape.tail else ""
    return rules.add(f"call_{i}", f"{_text(rules, shape.head, name)} {arguments}{tail}")


def wrap(fmt: ToolFormat, calls: str, lit: Literal) -> str:
    """The start rule's body around the alternatives ``calls``: the family's region markers."""
    opening, closing = fmt.shape.region
    if not opening:
        return calls
    return f"{lit(opening)} ({calls}) {lit(closing)}"


def tool_grammar(
    fmt: ToolFormat, tools: list[tuple[str, dict[str, Any]]], lit: Literal, thinking: bool = False
) -> str:
    """The Lark grammar of one call of any of ``tools`` (name, parameters' schema); with
    ``thinking`` (the prompt opened a think block), the block's text and its close come first."""
    rules = Rules(lit)
    names = [call_rule(fmt, rules, i, name, schema) for i, (name, schema) in enumerate(tools)]
    start = wrap(fmt, " | ".join(names), lit)
    if thinking:
        close = lit(THINK_CLOSE)
        if close == json.dumps(THINK_CLOSE):  # plain text: the block is one lazy lexeme
            rules.lines.append(f"think[lazy]: /(?s:.*){_regex_text(THINK_CLOSE)}/")
        else:  # a special token ends the text
            rules.lines.append(f"think: /(?s:.*)/ {close}")
        start = f'think ("\\n" | "\\n\\n")? {start}'
    return f"start: {start}\n" + "\n".join(rules.lines)
