"""Tool calls of the real chat templates' families through the real openai client against a
real server (templates from llama.cpp's ``models/templates``; the weights are the embedded
model's): an answer written in a family's call format (a canned backend, one token at a time)
comes back as ``tool_calls``, its think block as ``reasoning_content`` and the text before
the calls as content, streamed and not; and a named or required ``tool_choice`` makes the real
model write its family's call under the grammar, which comes back as that call."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import jsonschema
import pytest
from llguidance import LLMatcher, LLTokenizer
from tokenizers import Tokenizer

from seamline.app import LocalModel
from seamline.params import SamplingParams
from seamline.runtime.backend import LocalBackend, Readiness
from seamline.runtime.sampling import TokenEvent
from seamline.server.tool_formats import FORMATS
from seamline.server.tool_grammars import lark_text, tool_grammar
from tests.support.api import NAME, client_for, serve
from tests.support.tool_families import (
    FAMILIES,
    TOOLS,
    WEATHER,
    full_answer,
    render,
    template,
)

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
BOUNDED = {  # a schema a small model's answer under the grammar ends in
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
NO_THINKING = {
    "chat_template_kwargs": {"enable_thinking": False}
}  # the model calls at once (see the unit tests)
BOUNDED_TOOLS = [
    {"type": "function", "function": {**TOOLS[0]["function"], "parameters": BOUNDED}},
    TOOLS[1],
]
CANNED = ["DeepSeek-V4", "gpt-oss", "GLM-4.7-Flash", "Qwen3-Coder", "Mistral-Nemo", "Kimi-K2"]
GENERATED = [
    "DeepSeek-V3.2",
    "gpt-oss",
    "GLM-4.6",
    "Qwen3-Coder",
    "Llama-3.3",
    "Mistral-Small-3.2",
    "Kimi-K2",
]


class Canned:
    """A backend whose model answers with fixed text (its tokens, one at a time)."""

    def __init__(self, model: LocalModel, answer: str, chat_template: str) -> None:
        self.codec = dataclasses.replace(model.codec, chat_template=chat_template, _template=None)
        self.model_name, self.context_length, self.answer = NAME, 4096, answer

    def readiness(self) -> Readiness:
        return Readiness(True)

    async def generate(
        self, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        for token in self.codec.encode(self.answer):
            yield TokenEvent(token)
        yield TokenEvent(self.codec.stop_ids[0], finish_reason="stop")  # the model's end of turn


def _calls(calls: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("family", CANNED)
def test_a_familys_answer_comes_back_as_tool_calls_reasoning_and_content(
    model: LocalModel, family: str
) -> None:
    fam = FAMILIES[family]
    answer = full_answer(fam, render(family, ASK))
    with serve(Canned(model, answer, template(family))) as url:  # type: ignore[arg-type]
        client = client_for(url)
        ask: dict[str, Any] = dict(model=NAME, messages=ASK, tools=TOOLS, max_tokens=400)
        reply = client.chat.completions.create(**ask)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert _calls(choice.message.tool_calls or []) == fam.calls
        assert (choice.message.content or "").strip() == fam.content
        assert (
            (choice.message.model_extra or {}).get("reasoning_content") or ""
        ).strip() == fam.reasoning
        deltas, content, reasoning, finish = [], "", "", None
        for chunk in client.chat.completions.create(stream=True, **ask):
            for c in chunk.choices:
                deltas += c.delta.tool_calls or []
                content += c.delta.content or ""
                reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
                finish = c.finish_reason or finish
        assert (
            finish == "tool_calls"
            and content.strip() == fam.content
            and reasoning.strip() == fam.reasoning
        )
        streamed = {}
        for d in deltas:
            name, args = streamed.get(d.index, ("", ""))
            streamed[d.index] = (
                name + (d.function.name or ""),
                args + (d.function.arguments or ""),
            )
        assert [(n, json.loads(a)) for _, (n, a) in sorted(streamed.items())] == fam.calls
        # the calls and their results go back through the template: the next turn renders
        history = [
            *ASK,
            choice.message.model_dump(exclude_none=True),
            *(
                {"role": "tool", "tool_call_id": c.id, "content": "sunny"}
                for c in choice.message.tool_calls or []
            ),
        ]
        again = client.chat.completions.create(
            model=NAME, messages=history, tools=TOOLS, max_tokens=400
        )
        assert again.usage is not None and again.usage.prompt_tokens > reply.usage.prompt_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize("family", GENERATED)
def test_a_required_call_is_written_in_the_familys_format(model: LocalModel, family: str) -> None:
    """The grammar makes the real model call the tool in its family's format (compiled against
    the served tokenizer), and that text is read back as the call."""
    codec = dataclasses.replace(model.codec, chat_template=template(family), _template=None)
    with serve(LocalBackend(model.engine, codec, NAME)) as url:
        client = client_for(url)
        named = client.chat.completions.create(
            model=NAME,
            messages=ASK,
            tools=BOUNDED_TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},  # type: ignore[arg-type]
            temperature=0,
            max_tokens=300,
            extra_body=NO_THINKING,
        )
        choice = named.choices[0]
        assert choice.finish_reason == "stop" and choice.message.tool_calls, choice
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), BOUNDED)
        if FAMILIES[family].fmt.startswith("mistral"):
            assert len(call.id) == 9 and call.id.isalnum()
        required = client.chat.completions.create(
            model=NAME,
            messages=ASK,
            tools=BOUNDED_TOOLS,
            tool_choice="required",  # type: ignore[arg-type]
            temperature=0,
            max_tokens=300,
            extra_body=NO_THINKING,
        )
        assert (
            required.choices[0].finish_reason == "tool_calls"
            and required.choices[0].message.tool_calls
        )
        assert required.choices[0].message.tool_calls[0].function.name in (
            "get_weather",
            "get_time",
        )


def test_a_think_close_that_is_a_special_token_ends_the_reasoning_in_the_grammar(
    model: LocalModel,
) -> None:
    """Where the tokenizer marks ``</think>`` special, the grammar after an opened think block
    names that token: the reasoning ends there, and its spelling in text does not end it."""
    spec = json.loads(model.codec.tokenizer.to_str())
    entry = next(
        e for e in spec["added_tokens"] if e["id"] == 8 and e["special"]
    )  # one of its special tokens
    spec["model"]["vocab"]["</think>"] = spec["model"]["vocab"].pop(entry["content"])
    entry["content"] = "</think>"
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    fam = FAMILIES["DeepSeek-V3.2"]
    lit = partial(lark_text, specials={"</think>": 8})
    grammar = LLMatcher.grammar_from_lark(
        tool_grammar(FORMATS[fam.fmt], [("get_weather", WEATHER)], lit, thinking=True)
    )
    ll = LLTokenizer(tokenizer.to_str())

    def accepts(ids: list[int]) -> bool:
        matcher = LLMatcher(ll, grammar, log_level=0)
        return (
            bool(matcher.consume_tokens(ids)) and matcher.is_accepting() and not matcher.is_error()
        )

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    assert ids("</think>") == [8]  # the text parses as the special token
    assert accepts(ids("Rome, so the weather tool.") + [8] + ids("\n\n" + fam.required))
    spelled = [
        i for piece in ("</", "think", ">") for i in ids(piece)
    ]  # the same text, not the token
    assert not accepts(ids("Rome.") + spelled + ids(fam.required))
