"""Concurrent streaming clients against an OpenAI-compatible server, as a serving benchmark's.

``python -m seamline_bench.load URL MODEL CLIENTS PROMPTS_JSON MAX_TOKENS`` runs one wave:
CLIENTS streams start together, each with its own prompt (``PROMPTS_JSON``: a list of texts)
and ``max_tokens`` generated tokens with ``ignore_eos`` (an extension seamline accepts as vLLM
does, and llama-server too). Prints one JSON line: generated tokens over the wave's wall time
(prefill included), and every stream's time to first token, inter-token gaps and decode rate
(tokens after the first over the time from the first to the last).

It runs as its own process so that a benchmark can put it in a network namespace and pin it.
It posts the requests and reads their server-sent events itself, with httpx on uvloop, as
vLLM's serving benchmark does, rather than through the `openai` client (which the tests use):
on a two-core machine the load generator shares a core with a stage, and the client's typed
objects for every chunk cost 0.4 ms of CPU a token here against 0.18 (measured: 1.6 s against
0.7 s over a wave of 64 streams of 64 tokens), time the stage beside it lost.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

WORDS = (
    "river stone light garden window market letter winter harbor forest signal engine paper "
    "silver morning bridge island candle thunder meadow orchard compass lantern valley ocean "
    "history number station copper machine festival library picture mountain question travel "
    "village weather yellow planet rhythm shadow storm summer teacher tower voyage wheel"
).split()


def make_prompts(count: int, low: int, high: int, seed: int, encode: Any) -> list[str]:
    """``count`` distinct texts of ``low`` to ``high`` tokens (spread evenly), by ``encode``."""
    rng = random.Random(seed)
    lengths = [low + (high - low) * i // max(1, count - 1) for i in range(count)]
    prompts = []
    for index, length in enumerate(lengths):
        words = [f"Note {seed}-{index}:"]
        while len(encode(" ".join(words))) < length:
            words.append(rng.choice(WORDS))
        prompts.append(" ".join(words[:-1] if len(encode(" ".join(words))) > length else words))
    return prompts


class StreamError(RuntimeError):
    """An error event in a stream, or a reply that is not one."""


async def _stream(http: Any, url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    began = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    async with http.stream("POST", f"{url}/completions", json=body) as response:
        if response.status_code != 200:
            raise StreamError(f"HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for chunk in _events(response):
            if "error" in chunk:
                raise StreamError(f"error event: {chunk['error']}")
            choices = chunk.get("choices")
            if choices and choices[0].get("text"):
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    ends = [began, *arrivals]
    tokens = tokens or len(arrivals)  # a server without usage: one token per chunk
    decode_s = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    return {
        "ttft_ms": (arrivals[0] - began) * 1e3 if arrivals else None,
        "itl_ms": [(b - a) * 1e3 for a, b in zip(ends[1:], ends[2:])],
        "tokens": tokens,
        # the stream's decode rate: tokens after the first over the time from the first to the last
        "decode_tok_s": (tokens - 1) / decode_s if decode_s > 0 else None,
    }


async def _events(response: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON of each ``data:`` line of a server-sent event stream, up to ``[DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


async def run_wave(url: str, model: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(
        max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4
    )
    async with httpx.AsyncClient(limits=limits, timeout=3600) as http:
        # this process's first request pays for its connection pool's set-up, which would count
        # as the server's first-token latency: one listing of the models first, off the clock
        (await http.get(f"{url}/models")).raise_for_status()
        began = time.perf_counter()
        results = await asyncio.gather(
            *(_stream(http, url, model, p, max_tokens) for p in prompts), return_exceptions=True
        )
        wall = time.perf_counter() - began
    done = [r for r in results if isinstance(r, dict)]
    errors = [repr(r) for r in results if not isinstance(r, dict)]
    tokens = sum(int(r["tokens"]) for r in done)
    return {
        "clients": len(prompts),
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "ttft_ms": [r["ttft_ms"] for r in done if r["ttft_ms"] is not None],
        "itl_ms": [gap for r in done for gap in r["itl_ms"]],
        "errors": errors[:3],
        "failed": len(errors),
        "decode_tok_s": [r["decode_tok_s"] for r in done if r["decode_tok_s"] is not None],
    }


def _run(wave: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """``wave`` on uvloop where it is installed (uvicorn's standard extra brings it): its event
    loop costs the load generator less CPU than asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(wave)
    return uvloop.run(wave)


def main(argv: list[str]) -> int:
    url, model, clients, prompts_path, max_tokens = argv
    prompts = json.loads(Path(prompts_path).read_text())[: int(clients)]
    print(json.dumps(_run(run_wave(url, model, prompts, int(max_tokens)))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
