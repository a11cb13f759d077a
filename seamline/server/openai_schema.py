"""OpenAI request bodies (pydantic) and the OpenAI error format.

Policy, chosen to keep the official ``openai`` client and common tools working:
- Types are strict (``"0.5"`` is not a number, ``true`` is not an integer).
- Unknown fields are ignored, as vLLM does (``user``, ``metadata``, ``store``, ...).
- Known OpenAI fields that would change the result and that seamline cannot honour
  (the legacy ``functions``, ``suffix``, ``best_of`` > 1) are rejected with 400 instead of
  being silently dropped.
- ``tools`` / ``tool_choice`` and ``response_format`` (``json_object``, ``json_schema``) as
  OpenAI has them; their grammars are compiled and checked by the API (server/grammars.py).
- ``logprobs`` / ``top_logprobs`` (up to ``MAX_TOP_LOGPROBS``), ``presence_penalty`` and
  ``frequency_penalty`` ([-2, 2]) and ``logit_bias`` (token id -> [-100, 100]) as OpenAI has them.
- Whatever reaches the nodes is bounded (``SamplingParams``' sizes): ``logit_bias`` at most 300
  entries and ``stop`` at most 4 strings (as OpenAI), a stop string at most 1024 characters, a
  ``response_format`` and each tool's ``parameters`` at most ``MAX_SCHEMA_BYTES`` of JSON, at
  most ``MAX_TOOLS`` tools (as OpenAI); the grammar a request compiles to is bounded too
  (server/grammars.py).
- ``top_k``, ``min_p`` and ``ignore_eos`` are accepted as extensions (``extra_body`` in the client).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from seamline.params import MAX_LOGIT_BIAS, MAX_STOP, MAX_STOP_CHARS, MAX_TOP_LOGPROBS

MAX_SCHEMA_BYTES = (
    64 << 10
)  # a response_format, a tool's parameters: as JSON (its grammar then fits the nodes')
MAX_TOOLS = 128  # as OpenAI's API allows
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_CHOICES = 16  # n: each choice is a sequence of its own in the batch
ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIError(Exception):
    """An error answered as ``{"error": {message, type, param, code}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCallItem(_Strict):
    """A tool call an earlier assistant message made (sent back with the tool's result)."""

    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None  # text parts are joined by the validator below
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, value: Any) -> str | None:
        return text_content(value)

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(
                f"a {self.role} message needs 'content' (only assistant content may be null)"
            )
        return self

    def as_template_dict(self) -> dict[str, Any]:
        """What the chat template sees: ``developer`` is rendered as ``system``."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.content or ""}
        if self.name is not None:
            out["name"] = self.name
        if (
            self.tool_calls
        ):  # templates read the arguments as a mapping, as transformers passes them
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments(c.function.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: the template shows it as it came


def text_content(value: Any) -> str | None:
    """A message's content: a string, or a list of ``{"type": "text", "text": ...}`` parts.

    Raises ValueError (not TypeError) throughout: pydantic turns only ValueError into a 400.
    """
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("content must be a string or a list of text parts")  # noqa: TRY004
    texts = []
    for part in value:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"only text content parts are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError("a text content part needs a string 'text'")  # noqa: TRY004
        texts.append(part["text"])
    return "\n".join(texts)


class _Sampling(_Strict):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension; 0 or -1: off
    min_p: float | None = Field(None, ge=0, le=1)  # extension
    ignore_eos: bool | None = False  # extension, as vLLM: generate through end-of-sequence tokens
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: list[str] | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)  # choices, sharing the prompt's prefill
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> list[str] | None:
        if value is None or isinstance(value, str):
            return None if value is None else [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("stop must be a string or a list of strings")
        if len(value) > MAX_STOP:
            raise ValueError(f"stop allows at most {MAX_STOP} strings, got {len(value)}")
        if any(len(s) > MAX_STOP_CHARS for s in value):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias(cls, value: Any) -> dict[str, float] | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("logit_bias maps token ids to numbers in [-100, 100]")  # noqa: TRY004
        if len(value) > MAX_LOGIT_BIAS:  # it travels to the nodes with every request
            raise ValueError(
                f"logit_bias allows at most {MAX_LOGIT_BIAS} entries, got {len(value)}"
            )
        for key, bias in value.items():
            if not str(key).isdigit():
                raise ValueError(f"logit_bias key {key!r} is not a token id")
            if (
                isinstance(bias, bool)
                or not isinstance(bias, (int, float))
                or not -100 <= bias <= 100
            ):
                raise ValueError(
                    f"logit_bias of token {key} must be a number in [-100, 100], got {bias!r}"
                )
        return {str(k): float(v) for k, v in value.items()}

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), v) for k, v in (self.logit_bias or {}).items())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; none: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check_json_size(value, "a tool's parameters")
        return value


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedTool(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")  # none: any JSON value
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs 'json_schema'")
        if self.json_schema is not None:  # its grammar travels to the nodes with every request
            check_json_size(self.json_schema.model_dump(by_alias=True), "response_format")
        return self


def check_json_size(value: Any, what: str) -> None:
    """ValueError when ``value`` as JSON is over ``MAX_SCHEMA_BYTES``."""
    size = len(json.dumps(value, ensure_ascii=False).encode())
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"{what} is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are taken")


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None  # the legacy spelling of tools
    function_call: Any = None
    response_format: ResponseFormat | None = None
    documents: list[dict[str, Any]] | None = None  # for templates that show retrieved documents
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # for templates that read it
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template

    def template_variables(self) -> dict[str, Any]:
        """The chat template's variables the request sets beyond messages, tools and documents."""
        out = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            out.setdefault("reasoning_effort", self.reasoning_effort)
        return out

    @field_validator("tools", mode="before")
    @classmethod
    def _few_tools(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_TOOLS:
            raise ValueError(f"tools allows at most {MAX_TOOLS} tools, got {len(value)}")
        return value

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, value: Any) -> Any:
        if value not in (None, [], "none", "auto"):
            raise ValueError(
                "the legacy 'functions' and 'function_call' are not supported; send 'tools' and 'tool_choice'"
            )
        return value

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise ValueError(f"max_tokens ({a}) and max_completion_tokens ({b}) disagree; send one")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs 'tools'")
        if (
            isinstance(self.tool_choice, NamedTool)
            and self.tool_choice.function.name not in self.tool_names()
        ):
            raise ValueError(
                f"tool_choice names {self.tool_choice.function.name!r}, which is not among 'tools'"
            )
        return self

    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or ()]

    @property
    def top(self) -> int | None:
        """How many alternatives each token's log-probability comes with (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        """A string, a list of one string, a list of token ids, or a list of one such list."""
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            return value
        raise ValueError(
            "prompt must be one string or one list of token ids (one prompt per request)"
        )

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"best_of must be 1, got {value}")
        return value

    @property
    def limit(self) -> int | None:
        return self.max_tokens

    @property
    def top(self) -> int | None:
        return self.logprobs


def param_name(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """The first pydantic/FastAPI validation error as an OpenAI 400."""
    if not errors:
        return bad_request("the request is invalid")
    err = errors[0]
    kind, loc = err.get("type", ""), tuple(err.get("loc", ()))
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        return bad_request(
            f"the request body is not valid JSON: {detail}{where}", None, "invalid_json"
        )
    param = param_name(loc)
    message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None and isinstance(err.get("input"), bytes):
        message = "the request body must be JSON, sent with Content-Type: application/json"
        return bad_request(message, None, "invalid_body")
    if param is None and kind in ("missing", "model_attributes_type", "model_type", "dict_type"):
        return bad_request("the request body must be a JSON object", None, "invalid_body")
    if param is None:
        return bad_request(f"invalid request: {message}", None, "invalid_value")
    if kind == "missing":
        return bad_request(f"missing required field '{param}'", param, "missing_required_parameter")
    shown = repr(err["input"])[:80] if "input" in err and kind != "value_error" else None
    suffix = f" (got {shown})" if shown is not None else ""
    return bad_request(f"invalid '{param}': {message}{suffix}", param, "invalid_value")
