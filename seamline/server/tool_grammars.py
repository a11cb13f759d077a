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
from seamline.server.tool_formats import DSML, ToolFormat

Literal = Callable[[str], str]  # text -> Lark items that match it exactly
NL = "\n"
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
    items = [f"<[{specials[part]}]>" if part in specials else json.dumps(part, ensure_ascii=False)
             for part in split.split(text) if part]  # fmt: skip
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


def _xml_params(rules: Rules, prefix: str, schema: dict[str, Any],
                head: Callable[[str, bool], str], close: str) -> str:  # fmt: skip
    """The parameters of an XML-style call: ``head(key, is_string)`` opens each, ``close``
    ends each value."""
    props: dict[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    items = []
    for j, (key, sub) in enumerate(props.items()):
        sub = sub if isinstance(sub, dict) else {}
        if _is_string(sub):
            value = rules.text_until(f"{prefix}_v{j}", close, sub)
        else:
            value = f"{rules.json(f'{prefix}_j{j}', sub)} {rules.lit(close)}"
        item = f"{rules.lit(head(key, _is_string(sub)))} {value}"
        items.append(item if key in required else f"({item})?")
    return " ".join(items) if items else '""'


def _json_call(kind: str, name: str) -> tuple[str, str]:
    """The text before and after a JSON-arguments call's arguments."""
    quoted = json.dumps(name, ensure_ascii=False)
    return {
        "hermes": ('<tool_call>\n{"name": ' + quoted + ', "arguments": ', "}\n</tool_call>"),
        "deepseek_v3": (
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n",
            "\n```<｜tool▁call▁end｜>",
        ),
        "deepseek_v31": (f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
        "harmony": (
            f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
            "<|call|>",
        ),
        "llama3": ('{"name": ' + quoted + ', "parameters": ', "}"),
        "mistral": (f"[TOOL_CALLS]{name}[ARGS]", ""),
        "mistral_json": ('{"name": ' + quoted + ', "arguments": ', ', "id": "'),
        "kimi_k2": (
            f"<|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ),
    }[kind]


def call_rule(fmt: ToolFormat, rules: Rules, i: int, name: str, schema: dict[str, Any]) -> str:
    """Adds the rules of a call of ``name`` to ``rules``; the name of its rule."""
    if fmt.name in ("qwen3_coder", "glm", "dsml_v32", "dsml_v4"):
        return rules.add(f"call_{i}", _xml_call(fmt.name, rules, f"p{i}", name, schema))
    head, tail = _json_call(fmt.name, name)
    body = f"{rules.lit(head)} {rules.json(f'args_{i}', schema)}"
    if tail:
        body += f" {rules.lit(tail)}"
    if (
        fmt.name == "mistral_json"
    ):  # then the call's id, 9 letters and digits, as its template requires
        body += " /[a-zA-Z0-9]{9}/ " + rules.lit('"}')
    return rules.add(f"call_{i}", body)


def _xml_call(kind: str, rules: Rules, prefix: str, name: str, schema: dict[str, Any]) -> str:
    if kind == "qwen3_coder":
        params = _xml_params(
            rules, prefix, schema, lambda k, s: f"<parameter={k}>\n", "\n</parameter>\n"
        )
        head, tail = f"<tool_call>\n<function={name}>\n", "</function>\n</tool_call>"
    elif kind == "glm":
        params = _xml_params(
            rules,
            prefix,
            schema,
            lambda k, s: f"<arg_key>{k}</arg_key>\n<arg_value>",
            "</arg_value>\n",
        )
        head, tail = f"<tool_call>{name}\n", "</tool_call>"
    else:

        def opening(key: str, is_string: bool) -> str:
            return f'<{DSML}parameter name="{key}" string="{"true" if is_string else "false"}">'

        params = _xml_params(rules, prefix, schema, opening, f"</{DSML}parameter>\n")
        head, tail = f'<{DSML}invoke name="{name}">\n', f"</{DSML}invoke>\n"
    return f"{rules.lit(head)} {params} {rules.lit(tail)}"


def wrap(fmt: ToolFormat, calls: str, lit: Literal) -> str:
    """The start rule's body around the alternatives ``calls``: the family's region markers."""
    if fmt.name in ("deepseek_v3", "deepseek_v31"):
        return f"{lit(fmt.starts[0])} ({calls}) {lit(fmt.closing)}"
    if fmt.name in ("dsml_v32", "dsml_v4"):
        return f"{lit(fmt.starts[0] + NL)} ({calls}) {lit(fmt.closing)}"
    if fmt.name == "mistral_json":
        return f"{lit('[TOOL_CALLS][')} ({calls}) {lit(']')}"
    if fmt.name == "kimi_k2":
        return f"{lit(fmt.starts[0])} ({calls}) {lit(fmt.closing)}"
    return calls


def tool_grammar(fmt: ToolFormat, tools: list[tuple[str, dict[str, Any]]], lit: Literal,
                 thinking: bool = False) -> str:  # fmt: skip
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
