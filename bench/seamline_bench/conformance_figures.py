"""One GGUF file's figures in `bench conformance`: the same prompts through seamline in this
process and through llama-server on 2 threads, compared (``conformance_compare``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from seamline_bench.conformance_compare import Answer, Comparison, compare, summarise
from seamline_bench.conformance_llama import LlamaReference

# seamline lists its 20 likeliest (llama-server its 5): where llama-server lists nothing (a
# token ending inside a UTF-8 character), the reference's token is still found among ours
OUR_TOP = 20


def file_figures(
    server: Path, gguf: Path, precision: str, prompts: tuple[str, ...], tokens: int, tmp: Path
) -> dict[str, Any]:
    """One file at ``precision`` against llama-server (an f32 KV cache where exact): the Gemma
    entry's figures."""
    ours = seamline_answers(gguf, precision, prompts, tokens)
    log = tmp / f"{gguf.stem}.llama.log"
    reference = LlamaReference(server, gguf, precision == "exact", threads=2, log=log)
    try:
        rows: list[Comparison] = []
        ids_equal = 0
        for prompt, (our_ids, answer) in zip(prompts, ours):
            ids_equal += our_ids == reference.prompt_ids(prompt)
            rows.append(compare(answer, reference.greedy(prompt, tokens)))
    finally:
        reference.close()
    figures = summarise(rows)
    noise = figures["max_logit_diff"]
    listed = [
        {
            "prompt": p,
            **r.as_dict(),
            "near_tie": r.reference_gap is not None and r.reference_gap < 2 * noise,
        }
        for p, r in zip(prompts, rows)
        if not r.equal
    ]
    return {"prompt_ids_equal": ids_equal, **figures, "partings": listed}


def seamline_answers(
    gguf: Path, precision: str, prompts: tuple[str, ...], tokens: int
) -> list[tuple[list[int], Answer]]:
    """Each prompt's ids and greedy answer, in this process at ``precision``."""
    from seamline.app import LocalModel
    from seamline.params import SamplingParams

    model = LocalModel.load(gguf, precision=precision, speculative="off")
    codec = model.codec
    params = SamplingParams(
        temperature=0, max_tokens=tokens, logprobs=OUR_TOP, stop_token_ids=codec.stop_ids
    )
    answers = []
    for prompt in prompts:
        ids = codec.encode_prompt(prompt)
        events = list(model.engine.events(ids, params))
        answer = Answer([e.token for e in events], [dict(e.top) for e in events])
        answers.append((ids, answer))
    return answers
