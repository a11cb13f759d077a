"""Tool calls through llama.cpp's real chat templates, family by family: the template renders
tools, a call, its result and a multi-turn history as the family writes them; an answer in
the family's call format, cut into pieces anywhere, comes back as calls (name and JSON
arguments), its reasoning apart and the text before the calls as content; and the grammar of
a required call accepts the family's call text and refuses other text."""

from __future__ import annotations

import json
import random
from functools import cache
from typing import Any

import pytest
from llguidance import LLMatcher, LLTokenizer

from seamline.server.tool_formats import FORMATS, ToolFormat, tool_format
from seamline.server.tool_grammars import lark_text, tool_grammar
from tests.support.tool_families import (
    CALL_ID,
    FAMILIES,
    HISTORY,
    ONE,
    SCHEMAS,
    WEATHER,
    full_answer,
    render,
    run,
    template,
)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_template_renders_tools_the_call_its_result_and_the_history(family: str) -> None:
    out = render(family, HISTORY)
    assert tool_format(template(family)) is FORMATS[FAMILIES[family].fmt]
    if FAMILIES[family].shows_tools:
        assert "The weather in a city" in out and "get_time" in out and "The time now" in out
    assert FAMILIES[family].rendered_call in out
    assert "sunny, 21 degrees" in out and out.index(FAMILIES[family].rendered_call) < out.index(
        "sunny, 21 degrees"
    )
    assert "Sunny and 21 degrees." in out and out.index("sunny, 21 degrees") < out.rindex(
        "And in Rome?"
    )


def _cuts(text: str, rng: random.Random) -> list[list[str]]:
    """The text whole, at every single cut point, a character at a time, and cut at random."""
    out = [[text], list(text)] + [[text[:at], text[at:]] for at in range(1, len(text))]
    for _ in range(20):
        points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        out.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)])])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_an_answer_cut_anywhere_comes_back_as_calls_reasoning_and_content(family: str) -> None:
    fam, source = FAMILIES[family], template(family)
    prompt = render(family, HISTORY)
    answer = full_answer(fam, prompt)
    for pieces in _cuts(answer, random.Random(family)):
        reasoning, content, calls = run(fam, source, prompt, pieces)
        assert reasoning.strip() == fam.reasoning, pieces
        assert content.strip() == fam.content, pieces
        assert [(c.name, json.loads(c.arguments)) for c in calls] == fam.calls, pieces
        assert [c.index for c in calls] == list(range(len(calls))) and len(
            {c.id for c in calls}
        ) == len(calls)
    if fam.fmt.startswith(
        "mistral"
    ):  # their templates take 9-character ids only, which the server gives
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
        render(
            family,
            [
                *HISTORY[:2],
                {"role": "assistant", "content": "", "tool_calls": [c.as_dict() for c in calls]},
            ],
        )


@cache
def _byte_tokenizer() -> LLTokenizer:
    return LLTokenizer("byte")


def _accepts(grammar: str, text: str) -> bool:
    matcher = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(list(text.encode()))
    return bool(ok) and not matcher.is_error() and matcher.is_accepting()


def _grammar(fmt: ToolFormat, names: list[str]) -> str:
    tools = [(name, SCHEMAS[name]) for name in names]
    return LLMatcher.grammar_from_lark(tool_grammar(fmt, tools, lambda text: lark_text(text, {})))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_grammar_of_a_required_call_takes_the_familys_call_and_nothing_else(
    family: str,
) -> None:
    fam = FAMILIES[family]
    fmt = FORMATS[fam.fmt]
    named, either = _grammar(fmt, ["get_weather"]), _grammar(fmt, ["get_weather", "get_time"])
    assert _accepts(named, fam.required) and _accepts(either, fam.required)
    reasoning, content, calls = run(
        fam, template(family), "", [fam.required]
    )  # read back as the call
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]
    assert reasoning == content == ""
    for wrong in (
        "Rome is sunny.",
        fam.required.replace("get_weather", "get_wether"),
        fam.required[:-1] + "?",
        "Sure. " + fam.required,
    ):
        assert not _accepts(named, wrong), wrong
    assert _accepts(named, fam.required.replace("Rome", "Rome and Milan"))
    if FORMATS[fam.fmt].shape.param is not None:  # XML-style: a string value is text up to a tag
        assert not _accepts(named, fam.required.replace("Rome", "Rome<"))
    else:  # the arguments are JSON by the tool's schema
        assert not _accepts(named, fam.required.replace('{"city":"Rome"}', '{"town":"Rome"}'))


@pytest.mark.parametrize(
    "family", [f for f in FAMILIES if FAMILIES[f].reasoning and FAMILIES[f].fmt != "harmony"]
)
def test_after_a_think_block_the_prompt_opened_the_grammar_takes_the_reasoning_first(
    family: str,
) -> None:
    """A reasoning template's prompt may open the think block: the answer's reasoning and the
    block's close come before the required call (else the call would be read as reasoning)."""
    fam = FAMILIES[family]
    lark = tool_grammar(
        FORMATS[fam.fmt],
        [("get_weather", WEATHER)],
        lambda text: lark_text(text, {}),
        thinking=True,
    )
    grammar = LLMatcher.grammar_from_lark(lark)
    for reasoning in ("Weather tool, <b>Rome</b>.</think>", "</think>\n\n", "Rome.\n</think>\n"):
        assert _accepts(grammar, reasoning + fam.required), reasoning
    for wrong in (
        fam.required,
        "a</think>b</think>" + fam.required,
        "Rome.</think>Sure. " + fam.required,
    ):
        assert not _accepts(grammar, wrong), wrong
    prompt = render(family, HISTORY[:2])
    assert prompt.rstrip().endswith("<think>") or fam.fmt in (
        "glm",
        "hermes",
    )  # GLM-4.6 and Qwen3 leave it to the answer
    reasoning, content, calls = run(
        fam, template(family), prompt, ["Weather tool.</think>\n\n", fam.required]
    )
    assert (reasoning, content.strip()) == ("Weather tool.", "") or not prompt.rstrip().endswith(
        "<think>"
    )
    assert [c.name for c in calls] == ["get_weather"]


WEATHER_CALL = '{"city": "Paris", "days": 2}'
VARIANTS = [
    # harmony: the recipient before the channel, a preamble on commentary, the call's end marker
    # taken as the stop token (not in the text)
    (
        "gpt-oss",
        f" to=functions.get_weather<|channel|>commentary json<|message|>{WEATHER_CALL}<|call|>",
        "",
        ONE,
    ),
    (
        "gpt-oss",
        "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>commentary "
        f"to=functions.get_weather <|constrain|>json<|message|>{WEATHER_CALL}",
        "Let me look.",
        ONE,
    ),
    (
        "Mistral-Small-3.2",
        f"[TOOL_CALLS]get_weather[CALL_ID]{CALL_ID}[ARGS]{WEATHER_CALL}",
        "",
        ONE,
    ),
    ("Llama-3.1", f'Sure. {{"name": "get_weather", "arguments": {WEATHER_CALL}}}', "Sure.", ONE),
    (
        "Qwen3-0.6B",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_CALL}}}',
        "",
        ONE,
    ),  # cut short
    (
        "Qwen3-Coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n21\n</parameter>\n<parameter=days>\n"
        "2\n</parameter>\n</function>",
        "",
        [("get_weather", {"city": "21", "days": 2})],
    ),
    (
        "GLM-4.6",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>21</arg_value>\n</tool_call>",
        "",
        [("get_weather", {"city": "21"})],
    ),  # a string by the schema, though it reads as JSON
    (
        "Kimi-K2",
        "No call here: <|tool_calls_section_begin|> broken",
        "No call here: <|tool_calls_section_begin|> broken",
        [],
    ),
]


@pytest.mark.parametrize("family, answer, content, calls", VARIANTS)
def test_the_other_ways_a_family_writes_its_calls(
    family: str, answer: str, content: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    fam = FAMILIES[family]
    prompt = (
        render(family, HISTORY[:2]) if fam.fmt != "glm" else ""
    )  # GLM-4.6's answer may open a block
    for at in range(len(answer) + 1):
        _, shown, made = run(fam, template(family), prompt, [answer[:at], answer[at:]])
        assert (
            shown.strip() == content and [(c.name, json.loads(c.arguments)) for c in made] == calls
        ), at
