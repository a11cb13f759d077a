"""A chat template rendered as Hugging Face and llama.cpp render it.

The variables are theirs: ``messages``, ``tools`` (only when there are some), ``documents``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``enable_thinking`` (llama-server
passes true unless asked otherwise), and whatever a request adds (``reasoning_effort``,
``chat_template_kwargs``). The globals and filters are those transformers gives a template:
``raise_exception``, ``strftime_now``, ``tojson`` (with its keyword arguments), and the
``loopcontrols`` extension; and the filters llama.cpp's template engine adds that real templates
use: ``from_json`` (DeepSeek-V3.2/V4) and ``items`` (Qwen3-Coder).

A tool call's ``arguments`` come as OpenAI sends them, JSON text, but templates differ in what
they expect: some write the text as is, others iterate it as a mapping or write it with
``tojson``. They are given as a mapping that prints as the JSON text it came as, so each
template gets what it expects (llama.cpp decides by probing the template instead).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from seamline.errors import RequestError


class TemplateError(RequestError):
    """The chat template failed to compile or to render; the message names its error."""


@dataclass
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""
    _compiled: jinja2.Template | None = field(default=None, repr=False)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text; RequestError where the template refuses the messages
        (``raise_exception``), TemplateError where it fails otherwise."""
        variables: dict[str, Any] = {
            "messages": [_with_mapped_arguments(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "enable_thinking": True,
        }
        if tools:
            variables["tools"] = tools
        if documents:
            variables["documents"] = documents
        variables.update(extra or {})
        try:
            return str(self.compiled().render(**variables))
        except RequestError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise TemplateError(f"the chat template failed to render: {_describe(exc)}") from exc

    def compiled(self) -> jinja2.Template:
        if self._compiled is None:
            try:
                self._compiled = _environment().from_string(self.source)
            except jinja2.TemplateError as exc:
                raise TemplateError(
                    f"the chat template does not compile: {_describe(exc)}"
                ) from exc
        return self._compiled


def _describe(exc: BaseException) -> str:
    line = getattr(exc, "lineno", None)
    where = f" (line {line})" if line else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = json.loads
    env.filters["items"] = lambda value: list(value.items())
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_template_error(message: str) -> None:
    raise RequestError(f"chat template refused the messages: {message}")


class Arguments(dict[str, Any]):
    """A tool call's arguments: a mapping that prints as the JSON text it was sent as."""

    def __init__(self, value: dict[str, Any], text: str) -> None:
        super().__init__(value)
        self.text = text

    def __str__(self) -> str:
        return self.text


def _with_mapped_arguments(message: Any) -> Any:
    """``message`` with each tool call's JSON-text arguments as ``Arguments`` (others as sent)."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(calls, list):
        return message
    return {**message, "tool_calls": [_mapped_call(call) for call in calls]}


def _mapped_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    text = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(text, str):
        return call
    try:
        value = json.loads(text)
    except ValueError:
        return call
    if not isinstance(value, dict):
        return call
    return {**call, "function": {**function, "arguments": Arguments(value, text)}}
