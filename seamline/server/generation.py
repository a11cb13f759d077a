"""One choice of a request as the API serves it: its tokens as text (stop strings applied,
never half a character), counted, metered (``metrics``), with their log-probabilities."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio

from seamline.params import SamplingParams
from seamline.runtime.backend import Backend
from seamline.runtime.sampling import DrawnToken
from seamline.server.logprobs import chat_logprobs, completion_logprobs
from seamline.server.metrics import RequestMeter
from seamline.text import StreamDecoder

Piece = tuple[str, DrawnToken | None]  # a token's new text ('' while held back) and the token (None: the flush)


class Generation:
    """One request's tokens as text: counts them, applies stop strings, knows why it ended."""

    def __init__(self, backend: Backend, prompt: list[int], params: SamplingParams, meter: RequestMeter) -> None:
        self.meter = meter
        self.codec = backend.codec
        self.text_offset = 0  # a completion's characters before the next token (its echo, if any)
        self.prompt_tokens = len(prompt)
        self.completion_tokens = 0
        self.finish_reason = "stop"
        self._limit = min(params.max_tokens, backend.context_length - len(prompt))
        self._decoder = StreamDecoder(backend.codec, params.stop_strings)
        self._tokens = backend.generate(prompt, params)
        self._first: DrawnToken | None = None
        self._closed = False
        self.logprobs = params.logprobs is not None

    async def start(self) -> None:
        """Await the first token, so that a refused request fails before any response."""
        self._first = await self._next()

    async def pieces(self) -> AsyncIterator[Piece]:
        """The new text for each generated token ('' while text is held back), with the token."""
        try:
            token = self._first
            while token is not None:
                self.completion_tokens += 1
                yield self._decoder.push(token), token
                if self._decoder.stopped:
                    self.finish_reason = "stop"  # a stop string
                    self.meter.end(self.finish_reason)
                    return
                token = await self._next()
            yield self._decoder.flush(), None
            self.finish_reason = "length" if self.completion_tokens >= self._limit else "stop"
            self.meter.end(self.finish_reason)
        except Exception:
            self.meter.end("error")
            raise
        finally:
            await self.close()

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

    def logprobs_of(self, tokens: list[DrawnToken], chat: bool) -> dict[str, Any]:
        """These tokens' log-probabilities as the response shows them (each token once: a
        completion's ``text_offset`` runs on over the calls)."""
        if chat:
            return chat_logprobs(self.codec, tokens)
        out = completion_logprobs(self.codec, tokens, self.text_offset)
        self.text_offset += sum(len(t) for t in out["tokens"])
        return out

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    async def _next(self) -> DrawnToken | None:
        try:
            token = await anext(self._tokens)
        except StopAsyncIteration:
            return None
        self.meter.token()  # timed as it arrives
        return token if isinstance(token, DrawnToken) else DrawnToken(token)
