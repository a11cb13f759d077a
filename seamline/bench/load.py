"""Concurrent streaming clients against an OpenAI-compatible server, as the real `openai` client.

``python -m seamline.bench.load URL MODEL CLIENTS PROMPTS_JSON MAX_TOKENS`` runs one wave:
CLIENTS streams start together, each with its own prompt (``PROMPTS_JSON``: a list of texts)
and ``max_tokens`` generated tokens with ``ignore_eos`` (an extension seamline accepts as vLLM
does, and llama-server too). Prints one JSON line: generated tokens over the wave's wall time
(prefill included), and every stream's time to first token, inter-token gaps and decode rate
(tokens after the first over the time from the first to the last).

It runs as its own process so that a benchmark can put it in a network namespace and pin it.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
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


async def _stream(client: Any, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    began = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
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


async def run_wave(url: str, model: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    from openai import AsyncOpenAI

    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600,
                         http_client=httpx.AsyncClient(limits=limits, timeout=3600))  # fmt: skip
    try:
        # this process's first request pays for its lazy imports (20-30 ms here), which would count
        # as the server's first-token latency: one listing of the models first, off the clock
        await client.models.list()
        began = time.perf_counter()
        results = await asyncio.gather(*(_stream(client, model, p, max_tokens) for p in prompts),
                                       return_exceptions=True)  # fmt: skip
        wall = time.perf_counter() - began
    finally:
        await client.close()
    done = [r for r in results if isinstance(r, dict)]
    errors = [repr(r) for r in results if not isinstance(r, dict)]
    tokens = sum(int(r["tokens"]) for r in done)
    return {
        "clients": len(prompts), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
        "ttft_ms": [r["ttft_ms"] for r in done if r["ttft_ms"] is not None],
        "itl_ms": [gap for r in done for gap in r["itl_ms"]], "errors": errors[:3], "failed": len(errors),
        "decode_tok_s": [r["decode_tok_s"] for r in done if r["decode_tok_s"] is not None],
    }  # fmt: skip


def main(argv: list[str]) -> int:
    url, model, clients, prompts_path, max_tokens = argv
    prompts = json.loads(Path(prompts_path).read_text())[: int(clients)]
    print(json.dumps(asyncio.run(run_wave(url, model, prompts, int(max_tokens)))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
