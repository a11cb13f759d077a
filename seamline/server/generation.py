"""One choice of a request as the API serves it: its tokens as text (stop strings applied,
never half a character), counted, metered (``metrics``), with their log-probabilities."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio

from seamline.params import SamplingParams
from seamline.runtime.backend import Backend
from seamline.runtime.sampling import TokenEvent
from seamline.server.harmony import HarmonySplitter
from seamline.server.logprobs import chat_logprobs, completion_logprobs
from seamline.server.metrics import RequestMeter
from seamline.server.reasoning import Splitter
from seamline.server.tools import ToolCall, ToolStream
from seamline.text import StreamDecoder


@dataclass(frozen=True)
class Piece:
    """A token's new text ('' while held back), the token (None: the text left at the end),
    with think blocks the part of the text that is reasoning, with tools the calls made."""

    text: str
    token: TokenEvent | None
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = ()  # tool calls the text completed


class Generation:
    """One request's tokens as text: counts them, applies stop strings, knows why it ended."""

    def __init__(
        self, backend: Backend, prompt: list[int], params: SamplingParams, meter: RequestMeter
    ) -> None:
        self.meter = meter
        self.codec = backend.codec
        self.text_offset = 0  # a completion's characters before the next token (its echo, if any)
        self.prompt_tokens = len(prompt)
        self.completion_tokens = 0
        self.finish_reason = "stop"
        self._decoder = StreamDecoder(backend.codec, params.stop_strings)
        self._tokens = backend.generate(prompt, params)
        self._first: TokenEvent | None = None
        self._closed = False
        self.logprobs = params.logprobs is not None
        self.thinker: Splitter | None = (
            None  # a chat whose template has reasoning (``split_reasoning``)
        )
        self.tools: ToolStream | None = (
            None  # a chat whose answer is parsed for tool calls (``parse_tools``)
        )
        self.named_tool = False  # tool_choice named a function: it ends with "stop", as OpenAI's

    def split_reasoning(self, splitter: Splitter) -> None:
        """Tell the answer's reasoning from its content; harmony's markers are special tokens,
        so its text keeps them."""
        self.thinker = splitter
        if isinstance(splitter, HarmonySplitter):
            self._decoder.special = True

    def parse_tools(self, stream: ToolStream, named: bool) -> None:
        """Parse the answer for tool calls; their markers may be special tokens, so the text
        keeps special tokens (as vLLM's tool parsers have it)."""
        self.tools, self.named_tool = stream, named
        self._decoder.special = True
        if isinstance(self.thinker, HarmonySplitter):
            self.thinker.keep_calls = True  # its messages to tools come on as calls

    async def start(self) -> None:
        """Await the first token, so that a refused request fails before any response."""
        self._first = await self._next()

    async def pieces(self) -> AsyncIterator[Piece]:
        """The new text for each generated token ('' while text is held back), with the token;
        the request ends as the backend's last event says (or at a stop string)."""
        try:
            event = self._first or await self._next()
            while event.shown:
                self.completion_tokens += 1
                yield self._piece(self._decoder.push(event.token), event)
                if self._decoder.stopped:  # a stop string
                    last = self._piece("", None, last=True)
                    self._end("stop")
                    yield last
                    return
                if event.finish_reason is not None:
                    break
                event = await self._next()
            last = self._piece(self._decoder.flush(), None, last=True)
            self._end(event.finish_reason or "stop")
            yield last
        except Exception:
            self.meter.end("error")
            raise
        finally:
            await self.close()

    def _end(self, reason: str) -> None:
        if reason == "stop" and self.tools is not None and self.tools.calls and not self.named_tool:
            reason = "tool_calls"
        self.finish_reason = reason
        self.meter.end(reason)

    def _piece(self, text: str, token: TokenEvent | None, last: bool = False) -> Piece:
        reasoning, content = "", text
        if self.thinker is not None:
            reasoning, content = self.thinker.feed(text)
            if last:
                more_reasoning, more_content = self.thinker.flush()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self.tools is None:
            return Piece(content, token, reasoning)
        content, calls = self.tools.feed(content)
        if last:
            more_content, more_calls = self.tools.flush()
            content, calls = content + more_content, calls + more_calls
        return Piece(content, token, reasoning, tuple(calls))

    async def close(self) -> None:
        """Close the backend's iterator (cancels the request if it is still running)."""
        if self._closed:
            return
        self._closed = True
        self.meter.end("abort")  # ended before its last token (a no-op once it ended)
        aclose = getattr(self._tokens, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                await aclose()

    def logprobs_of(self, tokens: list[TokenEvent], chat: bool) -> dict[str, Any]:
        """These tokens' log-probabilities as the response shows them (each token once: a
        completion's ``text_offset`` runs on over the calls)."""
        if chat:
            return chat_logprobs(self.codec, tokens)
        out = completion_logprobs(self.codec, tokens, self.text_offset)
        self.text_offset += sum(len(t) for t in out["tokens"])
        return out

    async def _next(self) -> TokenEvent:
        try:
            event = await anext(self._tokens)
        except StopAsyncIteration:
            raise RuntimeError("the backend ended a request without its finish reason") from None
        if event.shown:
            self.meter.token()  # timed as it arrives
        return event
