"""A chat template rendered as Hugging Face and llama.cpp render it.

The variables are theirs: ``messages``, ``tools`` (only when there are some), ``documents``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``enable_thinking`` (llama-server
passes true unless asked otherwise), and whatever a request adds (``reasoning_effort``,
``chat_template_kwargs``). The globals and filters are those transformers gives a template:
``raise_exception``, ``strftime_now``, ``tojson`` (with its keyword arguments), and the
``loopcontrols`` extension.
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
            "messages": messages,
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
                raise TemplateError(f"the chat template does not compile: {_describe(exc)}") from exc
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
