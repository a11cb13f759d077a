"""The JSON of a response: a whole chat or text completion, or one stream chunk of it."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from seamline.server.tools import ToolCall


@dataclass(frozen=True)
class Choice:
    """One finished choice: its text, why it ended, and what came with it."""

    text: str
    finish: str
    logprobs: dict[str, Any] | None = None
    reasoning: str | None = None  # with a template that uses think blocks
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class Reply:
    """The shape of one response: chat (``message``/``delta``) or text completion (``text``)."""

    chat: bool
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> Reply:
        prefix = "chatcmpl-" if chat else "cmpl-"
        return cls(chat, model, prefix + uuid.uuid4().hex, int(time.time()))

    def full(self, choices: list[Choice], usage: dict[str, int]) -> dict[str, Any]:
        """The whole response."""
        out = []
        for index, choice in enumerate(choices):
            item: dict[str, Any] = {"index": index}
            if self.chat:
                item["message"] = _message(choice)
            else:
                item["text"] = choice.text
            item.update(logprobs=choice.logprobs, finish_reason=choice.finish)
            out.append(item)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": out, "usage": usage}

    def chunk(
        self,
        text: str | None,
        finish: str | None = None,
        role: bool = False,
        usage: bool = False,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
        reasoning: str | None = None,
        calls: tuple[ToolCall, ...] = (),
    ) -> dict[str, Any]:
        """One stream chunk of choice ``index``; ``usage`` adds ``"usage": null`` (OpenAI does
        when it will send usage); ``calls``: tool calls completed."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if reasoning is not None:
                delta["reasoning_content"] = reasoning
            if calls:
                delta["tool_calls"] = [call.as_dict(streamed=True) for call in calls]
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice.update(logprobs=logprobs, finish_reason=finish)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = {**self._head(obj), "choices": [choice]}
        return {**out, "usage": None} if usage else out

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def _message(choice: Choice) -> dict[str, Any]:
    """A chat choice's message: content null when the answer is only tool calls, as OpenAI's."""
    content = None if choice.calls and not choice.text.strip() else choice.text
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if choice.reasoning is not None:
        message["reasoning_content"] = choice.reasoning
    if choice.calls:
        message["tool_calls"] = [call.as_dict() for call in choice.calls]
    return message
