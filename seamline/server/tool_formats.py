"""The tool-call formats of the chat-template families, as one table: each ``ToolFormat`` names
the text that opens an answer's calls, how a written call is found and read, and how the
grammar of a required call writes it (``server/tool_grammars.py``). llama.cpp's chat parsers
(``common/chat*.cpp``) are the reference for what each family writes.

- ``hermes`` (Hermes, Qwen2.5/3): ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``.
- ``qwen3_coder``: ``<tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>``.
- ``glm`` (GLM-4.6): ``<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>``;
  ``glm47`` (GLM-4.7): the same without the newlines.
- ``deepseek_v3`` / ``deepseek_v31``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>…<｜tool▁call▁end｜>…``
  with V3's ``function<｜tool▁sep｜>N\\n```json\\n{...}\\n```` or V3.1's ``N<｜tool▁sep｜>{...}``.
- ``dsml`` (DeepSeek-V3.2: ``function_calls``; V4: ``tool_calls``): ``<｜DSML｜BLOCK>`` of
  ``<｜DSML｜invoke name="N">`` with ``<｜DSML｜parameter name="K" string="true|false">V</…>``.
- ``harmony`` (gpt-oss): a message to ``functions.N`` (``server/harmony.py`` passes it on as
  ``<|start|>assistant to=functions.N<|message|>{...}<|call|>``).
- ``llama3`` (Llama 3.1-3.3): ``{"name": N, "parameters": {...}}``, after ``<|python_tag|>`` or not.
- ``mistral`` (Small 3.2): ``[TOOL_CALLS]N[ARGS]{...}``; ``mistral_json`` (Nemo):
  ``[TOOL_CALLS][{"name": N, "arguments": {...}, "id": "…"}]``. Their call ids are 9 letters
  and digits, as their templates require.
- ``kimi_k2``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.N:I<|tool_call_argument_begin|>
  {...}<|tool_call_end|>…<|tool_calls_section_end|>``.

XML-style values (Qwen3-Coder, GLM, DSML's ``string="false"``) are JSON where they read as JSON
and the tool's schema does not make the parameter a string; otherwise the text as written.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Schemas = Mapping[str, dict[str, Any]]  # tool name -> its parameters' schema
Found = tuple[list[tuple[str, dict[str, Any]]], int]  # the calls read, and where they end
Finder = Callable[[str, Schemas], Found | None]
_DECODER = json.JSONDecoder()


def openai_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def nine_char_id() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True)
class CallShape:
    """How a required call is written, for its grammar (``server/tool_grammars.py``): the text
    before and after its arguments (``{name}``: the tool's name, ``{qname}``: as a JSON string,
    ``{id}``: a call id of 9 letters and digits), the region's markers around it, and for the
    XML-style families a parameter's opening (``{key}``, ``{string}``: true or false) and the
    text that closes its value; the others write the arguments as one JSON object."""

    head: str
    tail: str = ""
    region: tuple[str, str] = ("", "")
    param: tuple[str, str] | None = None


@dataclass(frozen=True)
class ToolFormat:
    name: str
    starts: tuple[str, ...]  # text that opens the calls region
    find: Finder  # the first complete call(s) in the region's pending text
    shape: CallShape
    find_unclosed: Finder | None = None  # a last call the answer ended inside, at its end
    new_id: Callable[[], str] = openai_id
    signs: tuple[str, ...] = ()  # what a template of the family holds (all of them)


def _arguments(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def _one(name: Any, arguments: Any, end: int) -> Found | None:
    args = _arguments(arguments)
    if not isinstance(name, str) or not name.strip() or args is None:
        return None
    return [(name.strip(), args)], end


def _json_at(text: str, at: int) -> tuple[Any, int] | None:
    """The JSON value starting at ``at`` (after whitespace) and where it ends; None if cut."""
    while at < len(text) and text[at] in " \n\t\r":
        at += 1
    try:
        return _DECODER.raw_decode(text, at)
    except ValueError:
        return None


def value_of(text: str, schema: dict[str, Any] | None) -> Any:
    """An XML-style parameter's value: the text where the schema says string, else its JSON."""
    kind = (schema or {}).get("type")
    if kind == "string" or (isinstance(kind, list) and kind == ["string"]):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _params(body: str, pattern: re.Pattern[str], schema: dict[str, Any] | None) -> dict[str, Any]:
    props = (schema or {}).get("properties") or {}
    return {
        m.group("key").strip(): value_of(m.group("value"), props.get(m.group("key").strip()))
        for m in pattern.finditer(body)
    }


# --- finders --------------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
_HERMES_CUT = re.compile(r"<tool_call>\s*(\{.*\})\s*$", re.S)


def _hermes(pattern: re.Pattern[str]) -> Finder:
    def find(text: str, schemas: Schemas) -> Found | None:
        match = pattern.search(text)
        if match is None:
            return None
        obj = _arguments(match.group(1))
        if obj is None:
            return None
        return _one(obj.get("name"), obj.get("arguments", obj.get("parameters")), match.end())

    return find


_DEEPSEEK = re.compile(
    r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>(?P<name>[^\n]*)\n```(?:json)?\n(?P<args>.*?)\n```"
    r"|(?P<name2>[^<]*?)<｜tool▁sep｜>(?P<args2>.*?))<｜tool▁call▁end｜>",
    re.S,
)


def _deepseek(text: str, schemas: Schemas) -> Found | None:
    match = _DEEPSEEK.search(text)
    if match is None:
        return None
    if match.group("name") is not None:
        return _one(match.group("name"), match.group("args"), match.end())
    return _one(match.group("name2"), match.group("args2"), match.end())


def _xml(call: re.Pattern[str], param: re.Pattern[str]) -> Finder:
    """A call whose ``name`` and ``body`` of parameters the patterns read."""

    def find(text: str, schemas: Schemas) -> Found | None:
        match = call.search(text)
        if match is None:
            return None
        name = match.group("name").strip()
        return [(name, _params(match.group("body"), param, schemas.get(name)))], match.end()

    return find


_CODER = re.compile(
    r"<tool_call>\s*<function=(?P<name>[^>\n]+)>(?P<body>.*?)</function>\s*</tool_call>", re.S
)
_CODER_CUT = re.compile(
    r"<tool_call>\s*<function=(?P<name>[^>\n]+)>(?P<body>.*?)</function>\s*$", re.S
)
_CODER_PARAM = re.compile(r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>", re.S)
_GLM = re.compile(
    r"<tool_call>(?P<name>[^<\n]+)\n?(?P<body>(?:\s*<arg_key>.*?</arg_value>)*)\s*</tool_call>",
    re.S,
)
_GLM_PARAM = re.compile(
    r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.S
)
DSML = "｜DSML｜"
_DSML = re.compile(rf'<{DSML}invoke name="(?P<name>[^"]+)">(?P<body>.*?)</{DSML}invoke>', re.S)
_DSML_PARAM = re.compile(
    rf'<{DSML}parameter name="(?P<key>[^"]+)" string="(?P<str>true|false)">(?P<value>.*?)'
    rf"</{DSML}parameter>",
    re.S,
)


def _dsml(text: str, schemas: Schemas) -> Found | None:
    match = _DSML.search(text)
    if match is None:
        return None
    args = {
        m.group("key"): m.group("value")
        if m.group("str") == "true"
        else value_of(m.group("value"), None)
        for m in _DSML_PARAM.finditer(match.group("body"))
    }
    return [(match.group("name").strip(), args)], match.end()


HARMONY_CALL = "<|start|>assistant to="  # how server/harmony.py passes a call's message on
_HARMONY = re.compile(
    r"<\|start\|>assistant to=functions\.(?P<name>[^<\s]+)<\|message\|>(?P<args>.*?)<\|call\|>",
    re.S,
)


def _harmony(text: str, schemas: Schemas) -> Found | None:
    match = _HARMONY.search(text)
    return None if match is None else _one(match.group("name"), match.group("args"), match.end())


def _llama3(text: str, schemas: Schemas) -> Found | None:
    at = text.find("{")
    read = _json_at(text, at) if at >= 0 else None
    if read is None or not isinstance(read[0], dict):
        return None
    obj, end = read
    return _one(obj.get("name"), obj.get("parameters", obj.get("arguments")), end)


_MISTRAL = re.compile(r"\[TOOL_CALLS\](?P<name>[^\[\]]+?)(?:\[CALL_ID\][^\[]*)?\[ARGS\]")


def _mistral(text: str, schemas: Schemas) -> Found | None:
    match = _MISTRAL.search(text)
    read = _json_at(text, match.end()) if match else None
    return None if match is None or read is None else _one(match.group("name"), read[0], read[1])


def _mistral_json(text: str, schemas: Schemas) -> Found | None:
    at = text.find("[TOOL_CALLS]")
    read = _json_at(text, at + len("[TOOL_CALLS]")) if at >= 0 else None
    if read is None:
        return None
    items = read[0] if isinstance(read[0], list) else [read[0]]
    calls = [
        _one(item.get("name"), item.get("arguments"), 0) if isinstance(item, dict) else None
        for item in items
    ]
    if not calls or any(c is None for c in calls):
        return None
    return [c[0][0] for c in calls if c], read[1]


_KIMI = re.compile(
    r"<\|tool_call_begin\|>\s*(?:functions\.)?(?P<name>[^<:]+?)(?::\d+)?\s*"
    r"<\|tool_call_argument_begin\|>(?P<args>.*?)<\|tool_call_end\|>",
    re.S,
)


def _kimi(text: str, schemas: Schemas) -> Found | None:
    match = _KIMI.search(text)
    return None if match is None else _one(match.group("name"), match.group("args"), match.end())


def _cut(pattern: re.Pattern[str], finder: Finder, close: str) -> Finder:
    """A finder for a call the answer ended inside before ``close``, which ``pattern`` reads."""

    def find(text: str, schemas: Schemas) -> Found | None:
        match = pattern.search(text)
        return None if match is None else finder(match.group(0) + close, schemas)

    return find


_V3 = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
_V32 = (f"<{DSML}function_calls>", f"</{DSML}function_calls>")
_V4 = (f"<{DSML}tool_calls>", f"</{DSML}tool_calls>")
_KIMI_REGION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")


def _dsml_shape(region: tuple[str, str]) -> CallShape:
    param = (f'<{DSML}parameter name="{{key}}" string="{{string}}">', f"</{DSML}parameter>\n")
    return CallShape(
        f'<{DSML}invoke name="{{name}}">\n',
        f"</{DSML}invoke>\n",
        (region[0] + "\n", region[1]),
        param,
    )


_HERMES_SHAPE = CallShape('<tool_call>\n{"name": {qname}, "arguments": ', "}\n</tool_call>")
_CODER_SHAPE = CallShape(
    "<tool_call>\n<function={name}>\n",
    "</function>\n</tool_call>",
    param=("<parameter={key}>\n", "\n</parameter>\n"),
)
_GLM_SHAPE = CallShape(
    "<tool_call>{name}\n",
    "</tool_call>",
    param=("<arg_key>{key}</arg_key>\n<arg_value>", "</arg_value>\n"),
)
_GLM47_SHAPE = CallShape(  # GLM-4.7 writes no newlines between the parts
    "<tool_call>{name}",
    "</tool_call>",
    param=("<arg_key>{key}</arg_key><arg_value>", "</arg_value>"),
)
_V3_SHAPE = CallShape(
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n", "\n```<｜tool▁call▁end｜>", _V3
)
_V31_SHAPE = CallShape("<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>", "<｜tool▁call▁end｜>", _V3)
_HARMONY_SHAPE = CallShape(
    "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", "<|call|>"
)
_NEMO_SHAPE = CallShape(
    '{"name": {qname}, "arguments": ', ', "id": "{id}"}', ("[TOOL_CALLS][", "]")
)
_KIMI_SHAPE = CallShape(
    "<|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    _KIMI_REGION,
)
_HERMES_CUT_FIND = _cut(_HERMES_CUT, _hermes(_HERMES), "</tool_call>")
_CODER_CUT_FIND = _cut(_CODER_CUT, _xml(_CODER, _CODER_PARAM), "</tool_call>")
LLAMA3_SIGN = '"parameters": dictionary of argument name'  # its prompt's instructions
TAG, CALLS = ("<tool_call>",), ("[TOOL_CALLS]",)

_TABLE = [  # in the order templates are told apart by their signs: the more specific first
    ToolFormat("dsml_v32", _V32[:1], _dsml, _dsml_shape(_V32), signs=(DSML, "function_calls")),
    ToolFormat("dsml_v4", _V4[:1], _dsml, _dsml_shape(_V4), signs=(DSML,)),
    ToolFormat("deepseek_v3", _V3[:1], _deepseek, _V3_SHAPE, signs=("tool▁calls▁begin", "```json")),
    ToolFormat("deepseek_v31", _V3[:1], _deepseek, _V31_SHAPE, signs=("tool▁calls▁begin",)),
    ToolFormat("kimi_k2", _KIMI_REGION[:1], _kimi, _KIMI_SHAPE, signs=_KIMI_REGION[:1]),
    ToolFormat(
        "glm47", TAG, _xml(_GLM, _GLM_PARAM), _GLM47_SHAPE, signs=("{function-name}<arg_key>",)
    ),
    ToolFormat("glm", TAG, _xml(_GLM, _GLM_PARAM), _GLM_SHAPE, signs=("<arg_key>",)),
    ToolFormat(
        "qwen3_coder",
        TAG,
        _xml(_CODER, _CODER_PARAM),
        _CODER_SHAPE,
        _CODER_CUT_FIND,
        signs=("<function=",),
    ),
    ToolFormat("hermes", TAG, _hermes(_HERMES), _HERMES_SHAPE, _HERMES_CUT_FIND, signs=TAG),
    ToolFormat(
        "mistral",
        CALLS,
        _mistral,
        CallShape("[TOOL_CALLS]{name}[ARGS]"),
        new_id=nine_char_id,
        signs=(*CALLS, "[ARGS]"),
    ),
    ToolFormat("mistral_json", CALLS, _mistral_json, _NEMO_SHAPE, new_id=nine_char_id, signs=CALLS),
    ToolFormat(
        "llama3",
        ("<|python_tag|>", '{"name"'),
        _llama3,
        CallShape('{"name": {qname}, "parameters": ', "}"),
        signs=(LLAMA3_SIGN,),
    ),
    ToolFormat(
        "harmony", (HARMONY_CALL,), _harmony, _HARMONY_SHAPE, signs=("<|channel|>", "<|message|>")
    ),
]
FORMATS: dict[str, ToolFormat] = {fmt.name: fmt for fmt in _TABLE}


def tool_format(template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template writes; None when it defines none."""
    if not template:
        return None
    return next((fmt for fmt in _TABLE if all(sign in template for sign in fmt.signs)), None)
