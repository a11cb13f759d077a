"""`bench spec`'s client: streaming chat completions through the real `openai` client, as its own
process, so that a bench can start it inside the network namespace its server listens in.

``python -m seamline_bench.spec_client URL MODEL TOKENS ASKS_JSON`` streams every ask at once
(``ASKS_JSON``: a list of [name, text, sampling]) and prints one JSON line: each stream's text,
completion tokens and decode rate (tokens after the first over the time from the first to the
last), the wave's tokens per second, and the server's ``/metrics`` text after it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx


async def run_wave(url: str, model: str, asks: list[list[Any]], tokens: int) -> dict[str, Any]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=url,
        api_key="none",
        max_retries=0,
        timeout=3600,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=3600),
    )
    try:
        began = time.perf_counter()
        streams = await asyncio.gather(
            *(_stream(client, model, name, text, sampling, tokens) for name, text, sampling in asks)
        )
        wall = time.perf_counter() - began
    finally:
        await client.close()
    metrics = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    return {
        "streams": streams,
        "tok_s": sum(s["tokens"] for s in streams) / wall,
        "metrics": metrics,
    }


async def _stream(
    client: Any, model: str, name: str, text: str, sampling: dict[str, Any], tokens: int
) -> dict[str, Any]:
    arrivals, pieces, count = [], [], 0
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=tokens,
        stream=True,
        stream_options={"include_usage": True},
        **sampling,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    return {
        "name": name,
        "text": "".join(pieces),
        "tokens": count,
        "decode_tok_s": (count - 1) / span if span > 0 else 0.0,
    }


def near_tie_where_they_part(
    url: str,
    model: str,
    text: str,
    sampling: dict[str, Any],
    other: str,
    tokens: int,
    near_tie: float,
) -> bool:
    """Whether, in the server's own answer with log-probabilities, the top two where it parts
    from ``other`` are within ``near_tie``."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "logprobs": True,
        "top_logprobs": 2,
        **sampling,
    }
    reply = httpx.post(url + "/chat/completions", json=body, timeout=600).json()
    done = ""
    for entry in reply["choices"][0]["logprobs"]["content"]:
        if not other.startswith(done + entry["token"]):
            top = entry["top_logprobs"]
            return len(top) == 2 and top[0]["logprob"] - top[1]["logprob"] < near_tie
        done += entry["token"]
    return False


def main(argv: list[str]) -> int:
    if argv[0] == "near-tie":
        url, model, tokens, ask_path, other_path, near_tie = argv[1:]
        _, text, sampling = json.loads(Path(ask_path).read_text())
        print(
            json.dumps(
                near_tie_where_they_part(
                    url,
                    model,
                    text,
                    sampling,
                    Path(other_path).read_text(),
                    int(tokens),
                    float(near_tie),
                )
            )
        )
        return 0
    url, model, tokens, asks_path = argv
    print(
        json.dumps(
            asyncio.run(run_wave(url, model, json.loads(Path(asks_path).read_text()), int(tokens)))
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
