"""Tool calls for the chat templates that define them: the tools go to the template, the
answer's calls are parsed out of its text (streamed as they complete), and a call the request
requires (``tool_choice`` "required" or a named function) is enforced by a grammar.

The formats, one per template family, and how the template tells them apart, are the table in
``server/tool_formats.py``; their grammars are in ``server/tool_grammars.py``.

Text before the first call is content. Calls region text that parses as no call is given
back as content at the end, as it was written. As OpenAI does, the finish reason is
"tool_calls" when the answer called tools, except for a named ``tool_choice`` ("stop").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from llguidance import LLMatcher

from seamline.server.grammars import GrammarCheck
from seamline.server.openai_schema import ChatRequest, NamedTool, ToolDef, bad_request
from seamline.server.reasoning import OPEN as THINK_OPEN
from seamline.server.reasoning import partial_tag, uses_think_blocks
from seamline.server.tool_formats import Schemas, ToolFormat, openai_id, tool_format
from seamline.server.tool_grammars import Literal, lark_text, tool_grammar

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=openai_id)
    index: int = 0  # its place among the answer's calls (a stream's deltas name it)

    def as_dict(self, streamed: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index} if streamed else {}
        return {
            **out,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask: the template's tools, whether the answer is parsed for
    calls, and the grammar of a required call ("" when none is required)."""

    tools: list[dict[str, Any]]
    fmt: ToolFormat | None
    grammar: str = ""
    named: bool = False
    schemas: Schemas = field(
        default_factory=dict
    )  # each tool's parameters (XML-style values' types)
    thinking_lark: str = ""  # the required call's grammar after a think block the prompt opened

    def grammar_after(self, prompt_text: str, check: GrammarCheck) -> str:
        """The grammar of the answer to this prompt: where the prompt opened a think block (as a
        reasoning template's does), the block's text and its close come before the call."""
        if (
            not self.grammar
            or not self.thinking_lark
            or not prompt_text.rstrip().endswith(THINK_OPEN)
        ):
            return self.grammar
        lark = LLMatcher.grammar_from_lark(self.thinking_lark)
        return check.check(lark, "tool_choice", "the required tool call", "tools")


def plan_tools(body: ChatRequest, template: str | None, check: GrammarCheck) -> ToolPlan:
    """Tools checked (each one's parameters compile; the template defines calls), and the
    grammar a required or named ``tool_choice`` imposes."""
    if not body.tools:
        return ToolPlan([], None)
    fmt = tool_format(template)
    if fmt is None:
        raise bad_request(
            "this model's chat template defines no tool calls; omit 'tools'",
            "tools",
            "tools_unsupported",
        )
    schemas = [_parameters(tool, i, check) for i, tool in enumerate(body.tools)]
    tools = [tool.model_dump(exclude_none=True, by_alias=True) for tool in body.tools]
    choice = body.tool_choice
    names = [t.function.name for t in body.tools]
    by_name = dict(zip(names, schemas))
    if choice == "none":
        return ToolPlan(tools, None)
    if choice in (None, "auto"):
        return ToolPlan(tools, fmt, schemas=by_name)
    chosen = [
        i
        for i, name in enumerate(names)
        if not isinstance(choice, NamedTool) or name == choice.function.name
    ]
    lit: Literal = partial(lark_text, specials=check.special_tokens())
    required = [(names[i], schemas[i]) for i in chosen]
    lark = tool_grammar(fmt, required, lit)
    grammar = check.check(
        LLMatcher.grammar_from_lark(lark), "tool_choice", "the required tool call", "tools"
    )
    thinking = (
        tool_grammar(fmt, required, lit, thinking=True) if uses_think_blocks(template) else ""
    )
    return ToolPlan(tools, fmt, grammar, isinstance(choice, NamedTool), by_name, thinking)


def _parameters(tool: ToolDef, index: int, check: GrammarCheck) -> dict[str, Any]:
    schema = tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS
    check.json_schema(
        schema, f"tools[{index}].function.parameters", f"tool {tool.function.name}'s parameters"
    )
    return schema


class ToolStream:
    """An answer's text, split into content and tool calls as it comes."""

    def __init__(self, fmt: ToolFormat, schemas: Schemas | None = None) -> None:
        self.fmt = fmt
        self.schemas: Schemas = schemas or {}
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
            starts = [at for start in self.fmt.starts if (at := self.pending.find(start)) >= 0]
            if not starts:
                hold = max(partial_tag(self.pending, start) for start in self.fmt.starts)
                cut = len(self.pending) - hold
                content, self.pending = self.pending[:cut], self.pending[cut:]
                return content, []
            at = min(starts)
            content, self.pending, self.in_calls = self.pending[:at], self.pending[at:], True
            self.region = self.pending
        found = []
        while (read := self.fmt.find(self.pending, self.schemas)) is not None:
            found += [self._numbered(name, args) for name, args in read[0]]
            self.pending = self.pending[read[1] :]
        return content, found

    def flush(self) -> tuple[str, list[ToolCall]]:
        """What is left once the answer ends: a last call cut before its closing tag, or the
        calls region as content when it held no call."""
        found: list[ToolCall] = []
        cut = self.fmt.find_unclosed
        read = cut(self.pending, self.schemas) if self.in_calls and cut is not None else None
        if read is not None:
            found += [self._numbered(name, args) for name, args in read[0]]
        rest, self.pending = self.pending, ""
        if not self.in_calls:
            return rest, found
        return ("" if self.calls else self.region), found

    def _numbered(self, name: str, arguments: dict[str, Any]) -> ToolCall:
        call = ToolCall(
            name, json.dumps(arguments, ensure_ascii=False), self.fmt.new_id(), len(self.calls)
        )
        self.calls.append(call)
        return call
