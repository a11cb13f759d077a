"""Tool calls for the chat templates that define them: the tools go to the template, the
answer's calls are parsed out of its text (streamed as they complete), and a call the request
requires (``tool_choice`` "required" or a named function) is enforced by a grammar.

Formats, told apart by the template:
- Hermes / Qwen: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, repeated.
- DeepSeek-V3: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n
  {...}\\n```<｜tool▁call▁end｜>`` … ``<｜tool▁calls▁end｜>`` (V3.1's ``NAME<｜tool▁sep｜>{...}``
  is parsed too, and is the required shape where the template writes it so).

Text before the first call is content. Calls region text that parses as no call is given
back as content at the end, as it was written. As OpenAI does, the finish reason is
"tool_calls" when the answer called tools, except for a named ``tool_choice`` ("stop").
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from llguidance import LLMatcher

from seamline.server.grammars import GrammarCheck, compact_schema
from seamline.server.openai_schema import ChatRequest, NamedTool, ToolDef, bad_request
from seamline.server.reasoning import partial_tag

HERMES_TAIL = "}\n</tool_call>"  # after a call's arguments
FENCED_TAIL = "\n```<｜tool▁call▁end｜>"  # after DeepSeek-V3's json block
Literal = Callable[[str], str]  # text -> Lark items that match it exactly
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    index: int = 0  # its place among the answer's calls (a stream's deltas name it)

    def as_dict(self, streamed: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index} if streamed else {}
        return {**out, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(name: Any, arguments: Any) -> ToolCall | None:
    """A call from parsed parts; None when they are not a name and a JSON object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name.strip(), json.dumps(arguments, ensure_ascii=False))


class HermesFormat:
    start = "<tool_call>"
    closing: tuple[str, ...] = ()
    pattern = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
    unclosed = re.compile(r"<tool_call>\s*(\{.*\})\s*$", re.S)  # the answer ended before its tag

    def parse(self, match: re.Match[str]) -> ToolCall | None:
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            return None
        return _call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) else None

    def call_rule(self, name: str, args: str, lit: Literal) -> str:
        head = lit('<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": ')
        return f"{head} {args} {lit(HERMES_TAIL)}"

    def wrap(self, calls: str, lit: Literal) -> str:
        return calls


class DeepSeekFormat:
    start = "<｜tool▁calls▁begin｜>"
    closing = ("<｜tool▁calls▁end｜>",)
    pattern = re.compile(r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>(?P<name>[^\n]*)\n```(?:json)?\n(?P<args>.*?)\n```"
                         r"|(?P<name2>[^<]*?)<｜tool▁sep｜>(?P<args2>.*?))<｜tool▁call▁end｜>", re.S)  # fmt: skip
    unclosed = None

    def __init__(self, fenced: bool) -> None:
        self.fenced = fenced  # V3 writes the arguments in a json block; V3.1 right after the name

    def parse(self, match: re.Match[str]) -> ToolCall | None:
        if match.group("name") is not None:
            return _call(match.group("name"), match.group("args"))
        return _call(match.group("name2"), match.group("args2"))

    def call_rule(self, name: str, args: str, lit: Literal) -> str:
        if self.fenced:
            head = lit(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n")
            return f"{head} {args} {lit(FENCED_TAIL)}"
        return f"{lit(f'<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>')} {args} {lit('<｜tool▁call▁end｜>')}"

    def wrap(self, calls: str, lit: Literal) -> str:
        return f"{lit(self.start)} ({calls}) {lit(self.closing[0])}"


ToolFormat = HermesFormat | DeepSeekFormat


def tool_format(template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template writes; None when it defines none."""
    if not template:
        return None
    if "tool▁calls▁begin" in template:
        return DeepSeekFormat(fenced="```json" in template)
    if "<tool_call>" in template:
        return HermesFormat()
    return None


def lark_text(text: str, specials: Mapping[str, int]) -> str:
    """``text`` as Lark items: string literals (JSON's escapes; the markers' own characters
    kept), and a special token of the tokenizer as that token (``<[id]>``): a special token
    is never spelled by other tokens, so the grammar must name it."""
    if not specials:
        return json.dumps(text, ensure_ascii=False)
    split = re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
    items = [f"<[{specials[part]}]>" if part in specials else json.dumps(part, ensure_ascii=False)
             for part in split.split(text) if part]  # fmt: skip
    return " ".join(items)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask: the template's tools, whether the answer is parsed for
    calls, and the grammar of a required call ("" when none is required)."""

    tools: list[dict[str, Any]]
    fmt: ToolFormat | None
    grammar: str = ""
    named: bool = False


def plan_tools(body: ChatRequest, template: str | None, check: GrammarCheck) -> ToolPlan:
    """Tools checked (each one's parameters compile; the template defines calls), and the
    grammar a required or named ``tool_choice`` imposes."""
    if not body.tools:
        return ToolPlan([], None)
    fmt = tool_format(template)
    if fmt is None:
        raise bad_request("this model's chat template defines no tool calls; omit 'tools'", "tools",
                          "tools_unsupported")  # fmt: skip
    schemas = [_parameters(tool, i, check) for i, tool in enumerate(body.tools)]
    tools = [tool.model_dump(exclude_none=True, by_alias=True) for tool in body.tools]
    choice = body.tool_choice
    if choice == "none":
        return ToolPlan(tools, None)
    if choice in (None, "auto"):
        return ToolPlan(tools, fmt)
    names = [t.function.name for t in body.tools]
    chosen = [i for i, name in enumerate(names) if not isinstance(choice, NamedTool) or name == choice.function.name]
    lit: Literal = partial(lark_text, specials=check.special_tokens())
    rules = [f"call_{i}: {fmt.call_rule(names[i], f'args_{i}', lit)}\nargs_{i}: %json {json.dumps(compact_schema(schemas[i]))}"
             for i in chosen]  # fmt: skip
    lark = f"start: {fmt.wrap(' | '.join(f'call_{i}' for i in chosen), lit)}\n" + "\n".join(rules)
    grammar = check.check(LLMatcher.grammar_from_lark(lark), "tool_choice", "the required tool call", "tools")
    return ToolPlan(tools, fmt, grammar, isinstance(choice, NamedTool))


def _parameters(tool: ToolDef, index: int, check: GrammarCheck) -> dict[str, Any]:
    schema = tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS
    check.json_schema(schema, f"tools[{index}].function.parameters", f"tool {tool.function.name}'s parameters")
    return schema


class ToolStream:
    """An answer's text, split into content and tool calls as it comes."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.pending = ""  # text not yet shown or parsed
        self.region = ""  # the calls region as written (given back as content if it holds no call)
        self.in_calls = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content safe to show, calls completed) after ``text``."""
        self.pending += text
        content = ""
        if self.in_calls:
            self.region += text
        else:
            at = self.pending.find(self.fmt.start)
            if at < 0:
                cut = len(self.pending) - partial_tag(self.pending, self.fmt.start)
                content, self.pending = self.pending[:cut], self.pending[cut:]
                return content, []
            content, self.pending, self.in_calls = self.pending[:at], self.pending[at:], True
            self.region = self.pending
        found = []
        while (match := self.fmt.pattern.search(self.pending)) is not None and (call := self.fmt.parse(match)):
            found.append(self._numbered(call))
            self.pending = self.pending[match.end() :]
        return content, found

    def flush(self) -> tuple[str, list[ToolCall]]:
        """What is left once the answer ends: a last call cut before its closing tag, or the
        calls region as content when it held no call."""
        found: list[ToolCall] = []
        unclosed = self.fmt.unclosed.search(self.pending) if self.in_calls and self.fmt.unclosed else None
        if unclosed is not None and (call := self.fmt.parse(unclosed)) is not None:
            found.append(self._numbered(call))
        rest, self.pending = self.pending, ""
        if not self.in_calls:
            return rest, found
        return ("" if self.calls else self.region), found

    def _numbered(self, call: ToolCall) -> ToolCall:
        numbered = replace(call, index=len(self.calls))
        self.calls.append(numbered)
        return numbered
