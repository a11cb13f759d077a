"""The chat-template families of the tool-call tests: for each, llama.cpp's template, its call
format, how it writes a call in the history, a model's answer in that format with the calls it
holds, and the required call its grammar writes; and the server's pipeline (reasoning splitter,
then call parser) to read an answer with."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any

from seamline.chat_template import ChatTemplate
from seamline.server.harmony import HarmonySplitter, uses_harmony
from seamline.server.reasoning import Splitter, ThinkSplitter, uses_think_blocks
from seamline.server.tool_formats import tool_format
from seamline.server.tools import ToolCall, ToolStream
from tests.support.llama_cpp import llama_cpp_source

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TIME = {"type": "object", "properties": {}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time now", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CALL_ID = "abc123xyz"  # 9 letters and digits: Mistral's templates take no other ids
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": CALL_ID,
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": json.dumps({"city": "Paris", "days": 2}),
                },
            }
        ],
    },
    {
        "role": "tool",
        "tool_call_id": CALL_ID,
        "name": "get_weather",
        "content": "sunny, 21 degrees",
    },
    {"role": "assistant", "content": "Sunny and 21 degrees."},
    {"role": "user", "content": "And in Rome?"},
]
BOTH = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
ONE = BOTH[:1]
DSML = "｜DSML｜"


@dataclass(frozen=True)
class Family:
    template: str  # llama.cpp's models/templates/<template>.jinja
    fmt: str
    rendered_call: str  # the history's call as the template writes it
    answer: str  # a model's answer: calls (after any reasoning and content)
    calls: list[tuple[str, dict[str, Any]]]
    required: str  # a named call of get_weather as its grammar writes it
    content: str = "Let me look."  # the answer's text before its calls
    reasoning: str = ""  # the answer's think block's text ("" for none)
    shows_tools: bool = (
        True  # V3.1's template shows no tool definitions (nor does llama.cpp add them)
    )


def _dsml(block: str) -> str:
    return (
        f'<{DSML}{block}>\n<{DSML}invoke name="get_weather">\n<{DSML}parameter name="city" string="true">Paris'
        f'</{DSML}parameter>\n<{DSML}parameter name="days" string="false">2</{DSML}parameter>\n</{DSML}invoke>\n'
        f'<{DSML}invoke name="get_time">\n</{DSML}invoke>\n</{DSML}{block}>'
    )


def _dsml_required(block: str) -> str:
    return (
        f'<{DSML}{block}>\n<{DSML}invoke name="get_weather">\n<{DSML}parameter name="city" string="true">Rome'
        f"</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}{block}>"
    )


V31_CALLS = (
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}'
    "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
HERMES_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
CODER_CALLS = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
)
GLM_CALLS = (
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
    "<arg_value>2</arg_value>\n</tool_call><tool_call>get_time</tool_call>"
)
KIMI_CALLS = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
    "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
)
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
LLAMA_REQUIRED = '{"name": "get_weather", "parameters": {"city":"Rome"}}'

FAMILIES = {
    "DeepSeek-V3.1": Family(
        "deepseek-ai-DeepSeek-V3.1",
        "deepseek_v31",
        '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}<｜tool▁call▁end｜>',
        V31_CALLS,
        BOTH,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city":"Rome"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        reasoning="Weather tool.",
        shows_tools=False,
    ),
    "DeepSeek-V3.2": Family(
        "deepseek-ai-DeepSeek-V3.2",
        "dsml_v32",
        _dsml("function_calls").split('<｜DSML｜invoke name="get_time')[0],
        "\n\n" + _dsml("function_calls"),
        BOTH,
        _dsml_required("function_calls"),
        reasoning="Weather tool.",
    ),
    "DeepSeek-V4": Family(
        "deepseek-ai-DeepSeek-V4",
        "dsml_v4",
        _dsml("tool_calls").split('<｜DSML｜invoke name="get_time')[0],
        "\n\n" + _dsml("tool_calls"),
        BOTH,
        _dsml_required("tool_calls"),
        reasoning="Weather tool.",
    ),
    "DeepSeek-V4-Flash": Family(
        "deepseek-ai-DeepSeek-V4-Flash-0731",
        "dsml_v4",
        _dsml("tool_calls").split('<｜DSML｜invoke name="get_time')[0],
        "\n\n" + _dsml("tool_calls"),
        BOTH,
        _dsml_required("tool_calls"),
        reasoning="Weather tool.",
    ),
    "gpt-oss": Family(
        "openai-gpt-oss-120b",
        "harmony",
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "days": 2}<|call|>',
        "<|channel|>analysis<|message|>Weather tool.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>',
        ONE,
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>',
        content="",
        reasoning="Weather tool.",
    ),
    "GLM-4.6": Family(
        "GLM-4.6",
        "glm",
        GLM_CALLS.split("<tool_call>get_time")[0],
        GLM_CALLS,
        BOTH,
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>",
        reasoning="Weather tool.",
    ),
    "GLM-4.7-Flash": Family(
        "GLM-4.7-Flash",
        "glm47",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>",
        GLM_CALLS.replace("\n", ""),
        BOTH,
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>",
        reasoning="Weather tool.",
    ),
    "Qwen3-0.6B": Family(
        "Qwen-Qwen3-0.6B",
        "hermes",
        HERMES_CALLS.split('\n<tool_call>\n{"name": "get_time')[0],
        "\n" + HERMES_CALLS,
        BOTH,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Rome"}}\n</tool_call>',
        reasoning="Weather tool.",
    ),
    "Qwen3-Coder": Family(
        "Qwen3-Coder",
        "qwen3_coder",
        CODER_CALLS.split("\n<tool_call>\n<function=get_time")[0],
        "\n" + CODER_CALLS,
        BOTH,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
    ),
    "Llama-3.1": Family(
        "meta-llama-Llama-3.1-8B-Instruct",
        "llama3",
        LLAMA_CALL,
        LLAMA_CALL,
        ONE,
        LLAMA_REQUIRED,
        content="",
    ),
    "Llama-3.2": Family(
        "meta-llama-Llama-3.2-3B-Instruct",
        "llama3",
        LLAMA_CALL,
        "<|python_tag|>" + LLAMA_CALL,
        ONE,
        LLAMA_REQUIRED,
        content="",
    ),
    "Llama-3.3": Family(
        "meta-llama-Llama-3.3-70B-Instruct",
        "llama3",
        LLAMA_CALL,
        LLAMA_CALL,
        ONE,
        LLAMA_REQUIRED,
        content="",
    ),
    "Mistral-Small-3.2": Family(
        "Mistral-Small-3.2-24B-Instruct-2506",
        "mistral",
        f'[TOOL_CALLS]get_weather[CALL_ID]{CALL_ID}[ARGS]{{"city": "Paris", "days": 2}}',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{}',
        BOTH,
        '[TOOL_CALLS]get_weather[ARGS]{"city":"Rome"}',
    ),
    "Mistral-Nemo": Family(
        "mistralai-Mistral-Nemo-Instruct-2407",
        "mistral_json",
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "Paris", "days": 2}}, "id": "{CALL_ID}"}}]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, "id": "abc123xyz"}, '
        '{"name": "get_time", "arguments": {}, "id": "def456uvw"}]',
        BOTH,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city":"Rome"}, "id": "a1b2c3d4e"}]',
    ),
    "Kimi-K2": Family(
        "moonshotai-Kimi-K2",
        "kimi_k2",
        KIMI_CALLS.split("<|tool_call_begin|>functions.get_time")[0],
        KIMI_CALLS,
        BOTH,
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city":"Rome"}<|tool_call_end|><|tool_calls_section_end|>',
    ),
}


@cache
def template(family: str) -> str:
    return (
        llama_cpp_source() / "models" / "templates" / f"{FAMILIES[family].template}.jinja"
    ).read_text()


def render(family: str, messages: list[dict[str, Any]]) -> str:
    return ChatTemplate(template(family), "<s>", "</s>").render(messages, TOOLS)


def full_answer(family: Family, prompt: str) -> str:
    """The family's answer after ``prompt``: its think block (opened by the prompt or by the
    answer), the content, then the calls."""
    think = ""
    if family.reasoning and family.fmt != "harmony":
        opened = prompt.rstrip().endswith("<think>")
        think = ("" if opened else "<think>") + family.reasoning + "</think>"
    return think + family.content + family.answer


def pipeline(family: Family, source: str, prompt: str) -> tuple[Splitter | None, ToolStream]:
    """The server's: the template's reasoning splitter, then the call parser on its content."""
    splitter: Splitter | None = None
    if uses_harmony(source):
        splitter = HarmonySplitter()
        splitter.keep_calls = True
    elif uses_think_blocks(source):
        splitter = ThinkSplitter(prompt)
    fmt = tool_format(source)
    assert fmt is not None
    return splitter, ToolStream(fmt, SCHEMAS)


def run(
    family: Family, source: str, prompt: str, pieces: list[str]
) -> tuple[str, str, list[ToolCall]]:
    splitter, stream = pipeline(family, source, prompt)
    reasoning = content = ""
    calls: list[ToolCall] = []
    for piece in [*pieces, None]:
        r, c = (
            (splitter.feed(piece) if piece is not None else splitter.flush())
            if splitter
            else ("", piece or "")
        )
        shown, made = stream.feed(c)
        if piece is None:
            more, late = stream.flush()
            shown, made = shown + more, made + late
        reasoning, content, calls = reasoning + r, content + shown, calls + made
    return reasoning, content, calls
