"""A request's choices answered: started together, streamed as server-sent events (interleaved
as they come) or collected whole, with usage counted once for the prompt; and any failure as
the OpenAI error a client sees (``backend_error``), in a response or as a stream's last event."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from seamline.errors import OverloadedError, RequestError, SeamlineError
from seamline.params import SamplingParams
from seamline.runtime.sampling import TokenEvent
from seamline.server.generation import Generation, Piece
from seamline.server.openai_schema import OpenAIError, bad_request
from seamline.server.replies import Choice, Reply
from seamline.server.tools import ToolCall

log = logging.getLogger("seamline.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def backend_error(exc: BaseException) -> OpenAIError:
    """An exception raised while serving a request, as the OpenAI error a client should see."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestError):
        return bad_request(str(exc), None, "invalid_request")
    if isinstance(exc, OverloadedError):
        return OpenAIError(429, str(exc), "rate_limit_error", None, "queue_full")
    if isinstance(exc, SeamlineError):
        log.warning("generation failed: %s", exc)
        return OpenAIError(
            503, f"generation failed: {exc}", "service_unavailable", None, "backend_error"
        )
    log.error("request crashed", exc_info=exc)
    message = f"internal error: {type(exc).__name__}: {exc}"
    return OpenAIError(500, message, "server_error", None, "internal_error")


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose source is always closed, however the response ends."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


async def sse_events(
    reply: Reply, gens: list[Generation], include_usage: bool, echo: str
) -> AsyncIterator[str]:
    """The SSE body: per choice a first chunk, a chunk per text piece and a finish chunk (the
    choices interleaved as they come), then usage and [DONE]."""
    try:
        for index in range(len(gens)):
            if reply.chat:
                yield sse(reply.chunk("", role=True, usage=include_usage, index=index))
            elif echo:
                yield sse(reply.chunk(echo, usage=include_usage, index=index))
        async for index, item in _pieces(gens):
            if item is None:
                finish = gens[index].finish_reason
                yield sse(
                    reply.chunk(
                        None if reply.chat else "", finish, usage=include_usage, index=index
                    )
                )
                continue
            token = item.token
            lps = (
                gens[index].logprobs_of([token], reply.chat)
                if gens[index].logprobs and token is not None
                else None
            )
            if item.text or item.reasoning or lps or item.calls:
                text = item.text if item.text or not (item.reasoning or item.calls) else None
                yield sse(
                    reply.chunk(
                        text,
                        usage=include_usage,
                        index=index,
                        logprobs=lps,
                        reasoning=item.reasoning or None,
                        calls=item.calls,
                    )
                )
        if include_usage:
            yield sse(reply.usage_chunk(usage_of(gens)))
    except Exception as exc:  # noqa: BLE001 - every failure becomes an error event
        yield sse(backend_error(exc).body())
        return
    finally:
        await close_all(gens)
    yield "data: [DONE]\n\n"


async def _pieces(gens: list[Generation]) -> AsyncIterator[tuple[int, Piece | None]]:
    """(choice, (text piece, token)) as each choice makes them, then (choice, None) when it ends."""
    if len(gens) == 1:
        async for piece in gens[0].pieces():
            yield 0, piece
        yield 0, None
        return
    queue: asyncio.Queue[tuple[int, Piece | None | BaseException]] = asyncio.Queue()

    async def pump(index: int, gen: Generation) -> None:
        try:
            async for piece in gen.pieces():
                queue.put_nowait((index, piece))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        for _ in range(len(gens)):
            while True:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield index, item
                if item is None:
                    break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_choices(gens: list[Generation], chat: bool, echo: str) -> list[Choice]:
    """Every choice whole."""
    texts, reasoning = [[echo] for _ in gens], [[] for _ in gens]  # type: list[list[str]], list[list[str]]
    drawn: list[list[TokenEvent]] = [[] for _ in gens]
    calls: list[list[ToolCall]] = [[] for _ in gens]
    async for index, item in _pieces(gens):
        if item is not None:
            texts[index].append(item.text)
            reasoning[index].append(item.reasoning)
            calls[index] += item.calls
            if item.token is not None:
                drawn[index].append(item.token)
    return [
        Choice(
            "".join(t),
            g.finish_reason,
            g.logprobs_of(d, chat) if g.logprobs else None,
            "".join(r) if g.thinker is not None else None,
            c,
        )
        for g, t, r, d, c in zip(gens, texts, reasoning, drawn, calls)
    ]


def usage_of(gens: list[Generation]) -> dict[str, int]:
    """The prompt counted once, every choice's tokens."""
    prompt, completion = gens[0].prompt_tokens, sum(g.completion_tokens for g in gens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def close_all(gens: list[Generation]) -> None:
    for gen in gens:
        await gen.close()


async def start_all(gens: list[Generation]) -> None:
    """Every choice's first token; when one fails, the others are stopped (then closed)."""
    starts = [asyncio.ensure_future(gen.start()) for gen in gens]
    try:
        await asyncio.gather(*starts)
    finally:
        for task in starts:
            task.cancel()
        await asyncio.gather(*starts, return_exceptions=True)


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Per choice: a seed of its own (seed + i when seeded: choice 0 is the n=1 answer)."""
    if n == 1:
        return [params]
    return [
        replace(params, seed=None if params.seed is None else params.seed + i) for i in range(n)
    ]
