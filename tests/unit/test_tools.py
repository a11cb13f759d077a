"""Tool calls: the parsers on canned answers of each template's format (whole and streamed a
character at a time), and a round trip with the real openai client against a real server
whose template defines tools (Hermes/Qwen's, and DeepSeek-V3's; the weights are the embedded
model's): a named or required ``tool_choice`` is enforced by the grammar, its arguments
validate against the tool's parameters, the calls stream as ``tool_calls`` deltas, and the
tool's result sent back gets an answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from seamline.app import LocalModel
from seamline.runtime.backend import LocalBackend
from seamline.server.tool_formats import FORMATS, ToolFormat, tool_format
from seamline.server.tools import ToolCall, ToolStream
from tests.support.api import NAME, client_for, serve
from tests.support.tools import TEMPLATES

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER,
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

HERMES_ANSWER = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
DEEPSEEK_V3_ANSWER = (
    "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
    "<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
DEEPSEEK_V31_ANSWER = (
    'Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", '
    '"unit": "celsius"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>"
)
EXPECTED = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]


def _run(fmt: ToolFormat, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    stream, content, calls = ToolStream(fmt), "", []
    for piece in pieces:
        shown, made = stream.feed(piece)
        content, calls = content + shown, calls + made
    shown, made = stream.flush()
    return content + shown, calls + made


@pytest.mark.parametrize(
    "fmt, answer",
    [
        (FORMATS["hermes"], HERMES_ANSWER),
        (FORMATS["deepseek_v3"], DEEPSEEK_V3_ANSWER),
        (FORMATS["deepseek_v31"], DEEPSEEK_V31_ANSWER),
    ],
)
def test_canned_answers_parse_whole_and_a_character_at_a_time(fmt: ToolFormat, answer: str) -> None:
    for pieces in ([answer], list(answer)):
        content, calls = _run(fmt, pieces)
        assert content.strip() == "Let me look."
        assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED
        assert len({c.id for c in calls}) == 2


def test_unparsable_calls_come_back_as_content_and_a_cut_call_is_still_read() -> None:
    broken = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert _run(FORMATS["hermes"], list(broken)) == (broken, [])
    cut = '<tool_call>\n{"name": "get_time", "arguments": {}}'  # the answer ended before its closing tag
    content, calls = _run(FORMATS["hermes"], [cut])
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    assert _run(FORMATS["hermes"], ["no tools here, <tool", " or a tag"]) == (
        "no tools here, <tool or a tag",
        [],
    )


def test_the_format_is_the_templates() -> None:
    assert tool_format((TEMPLATES / "hermes.jinja").read_text()) is FORMATS["hermes"]
    assert tool_format((TEMPLATES / "deepseek_v3.jinja").read_text()) is FORMATS["deepseek_v3"]
    assert tool_format("{{ messages }}") is None


def _client(model: LocalModel, template: str) -> Iterator[openai.OpenAI]:
    codec = replace(model.codec, chat_template=(TEMPLATES / template).read_text(), _template=None)
    with serve(LocalBackend(model.engine, codec, NAME)) as url:
        yield client_for(url)


@pytest.fixture(scope="module")
def hermes(model: LocalModel) -> Iterator[openai.OpenAI]:
    yield from _client(model, "hermes.jinja")


@pytest.fixture(scope="module")
def deepseek(model: LocalModel) -> Iterator[openai.OpenAI]:
    yield from _client(model, "deepseek_v3.jinja")


def _arguments(call: Any) -> dict[str, Any]:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    return arguments  # type: ignore[no-any-return]


def test_a_named_tool_choice_round_trip(hermes: openai.OpenAI) -> None:
    """The grammar makes the model call the named tool with valid arguments; the result sent
    back as a tool message is rendered by the template and answered."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    first = hermes.chat.completions.create(
        model=NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,  # type: ignore[arg-type]
        temperature=0.7,
        seed=1,
        max_tokens=80,
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "stop"  # as OpenAI answers a named tool_choice
    assert message.content is None and message.tool_calls and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert (
        call.type == "function"
        and call.function.name == "get_weather"
        and call.id.startswith("call_")
    )
    _arguments(call)
    history = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    second = hermes.chat.completions.create(
        model=NAME,
        messages=history,
        tools=TOOLS,
        tool_choice="none",  # type: ignore[arg-type]
        temperature=0,
        max_tokens=12,
    )
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    assert second.usage is not None and second.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize("server", ["hermes", "deepseek"])
def test_a_required_call_streams_as_tool_calls_deltas(
    server: str, request: pytest.FixtureRequest
) -> None:
    client: openai.OpenAI = request.getfixturevalue(server)
    stream = client.chat.completions.create(
        model=NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",  # type: ignore[arg-type]
        temperature=0,
        max_tokens=200,
        stream=True,
    )
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and deltas
    assert (
        {d.index for d in deltas} == {0}
        and deltas[0].id
        and deltas[0].function.name in ("get_weather", "get_time")
    )
    arguments = "".join(d.function.arguments or "" for d in deltas)
    if deltas[0].function.name == "get_weather":
        jsonschema.validate(json.loads(arguments), WEATHER)
    else:
        assert json.loads(arguments) == {}


@pytest.mark.parametrize(
    "tools, param",
    [
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
            "tools[0].function.parameters",
        ),
        ([{"type": "function", "function": {"name": "bad name!"}}], "tools[0].function.name"),
        ([{"type": "retrieval"}], "tools[0].type"),
    ],
)
def test_a_tool_that_is_no_valid_definition_is_a_400(
    hermes: openai.OpenAI, tools: list[Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        hermes.chat.completions.create(model=NAME, messages=ASK, tools=tools, max_tokens=4)  # type: ignore[arg-type]
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param, (
        caught.value.body
    )


def test_tools_on_a_template_without_them_or_an_unknown_choice_are_a_400(
    model: LocalModel, hermes: openai.OpenAI
) -> None:
    with serve(LocalBackend(model.engine, model.codec, NAME)) as url:
        with pytest.raises(openai.BadRequestError) as caught:
            client_for(url).chat.completions.create(
                model=NAME, messages=ASK, tools=TOOLS, max_tokens=4
            )  # type: ignore[arg-type]
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError):
        hermes.chat.completions.create(
            model=NAME,
            messages=ASK,
            tools=TOOLS,
            max_tokens=4,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "nowhere"}},
        )


def test_markers_that_are_special_tokens_are_drawn_as_those_tokens_and_parsed(
    model: LocalModel,
) -> None:
    """Some tokenizers mark ``<tool_call>`` special: the grammar names that token (it is never
    spelled by others), and the answer is decoded with special tokens kept, so it is parsed."""
    spec = json.loads(model.codec.tokenizer.to_str())
    renamed = {
        8: "<tool_call>",
        9: "</tool_call>",
    }  # two of the embedded tokenizer's special tokens
    for entry in spec["added_tokens"]:
        if entry["id"] in renamed:
            spec["model"]["vocab"][renamed[entry["id"]]] = spec["model"]["vocab"].pop(
                entry["content"]
            )
            entry["content"] = renamed[entry["id"]]
    codec = replace(
        model.codec,
        tokenizer=Tokenizer.from_str(json.dumps(spec)),
        chat_template=(TEMPLATES / "hermes.jinja").read_text(),
        _template=None,
    )
    assert codec.special_tokens()["<tool_call>"] == 8
    with serve(LocalBackend(model.engine, codec, NAME)) as url:
        reply = client_for(url).chat.completions.create(
            model=NAME,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},  # type: ignore[arg-type]
            temperature=0,
            max_tokens=80,
            logprobs=True,
        )
    choice = reply.choices[0]
    assert (
        choice.logprobs
        and choice.logprobs.content
        and choice.logprobs.content[0].token == "<tool_call>"
    )
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"
    _arguments(choice.message.tool_calls[0])
