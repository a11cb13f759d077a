"""``reasoning_content``: think blocks split from the answer, on canned model outputs for the
templates that use them (a generation prompt that opens the block, as DeepSeek-R1's; an answer
that opens it, as Qwen3's; a prompt that closes it at once, as V4's non-thinking turn), cut
into tokens anywhere; and through the real openai client, streamed and not."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest

from seamline.app import LocalModel
from seamline.params import SamplingParams
from seamline.runtime.backend import Readiness
from seamline.runtime.sampling import TokenEvent
from seamline.server.harmony import HarmonySplitter, uses_harmony
from seamline.server.reasoning import ThinkSplitter, uses_think_blocks
from tests.support.api import NAME, client_for, serve

CASES = [
    (
        "<｜Assistant｜><think>\n",
        "Paris is the capital.</think>\n\nParis.",
        "Paris is the capital.",
        "Paris.",
    ),
    ("<|im_start|>assistant\n", "<think>\nrecall\n</think>\n\nParis.", "\nrecall\n", "Paris."),
    ("<｜Assistant｜></think>", "Paris.", "", "Paris."),
    ("<|im_start|>assistant\n", "Paris, not <think>.", "", "Paris, not <think>."),
    ("<｜Assistant｜><think>", "still thinking", "still thinking", ""),
]


@pytest.mark.parametrize("prompt, output, reasoning, content", CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_think_blocks_split_from_the_answer_wherever_the_tokens_cut(
    prompt: str, output: str, reasoning: str, content: str, size: int
) -> None:
    splitter, got = ThinkSplitter(prompt), ["", ""]
    for at in range(0, len(output), size):
        r, c = splitter.feed(output[at : at + size])
        assert not any(tag in r for tag in ("</th", "<thi"))  # no piece of a tag is ever shown
        assert "<think>" in content or not any(tag in c for tag in ("</th", "<thi"))
        got[0], got[1] = got[0] + r, got[1] + c
    r, c = splitter.flush()
    assert (got[0] + r, got[1] + c) == (reasoning, content)


class Canned:
    """A backend whose model answers with fixed text (its tokens, one at a time)."""

    def __init__(self, model: LocalModel, answer: str, template: str) -> None:
        self.codec = dataclasses.replace(model.codec, chat_template=template)
        self.model_name, self.context_length, self.answer = NAME, 2048, answer

    def readiness(self) -> Readiness:
        return Readiness(True)

    async def generate(
        self, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        tokens = self.codec.encode(self.answer)
        for i, token in enumerate(tokens[: params.max_tokens]):
            yield TokenEvent(token, finish_reason="length" if i + 1 == params.max_tokens else None)
        if len(tokens) < params.max_tokens:
            yield TokenEvent(
                self.codec.stop_ids[0], finish_reason="stop"
            )  # the model's end of turn


def test_the_api_returns_reasoning_content_apart() -> None:
    template = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|><think>\n"
    assert uses_think_blocks(template + "</think>") and not uses_think_blocks("{{ messages }}")
    backend = Canned(
        LocalModel.load(),
        "The capital of France is Paris.</think>\n\nParis.",
        template + "{# </think> #}",
    )
    with serve(backend) as url:  # type: ignore[arg-type]
        client = client_for(url)
        ask = dict(
            model=NAME, messages=[{"role": "user", "content": "Capital of France?"}], max_tokens=64
        )
        reply = client.chat.completions.create(**ask)  # type: ignore[call-overload]
        message = reply.choices[0].message
        assert (
            message.content == "Paris."
            and message.model_extra["reasoning_content"] == "The capital of France is Paris."
        )
        chunks = [
            c.choices[0].delta
            for c in client.chat.completions.create(stream=True, **ask)
            if c.choices
        ]  # type: ignore[call-overload]
        assert "".join(d.content or "" for d in chunks) == "Paris."
        assert (
            "".join((d.model_extra or {}).get("reasoning_content") or "" for d in chunks)
            == "The capital of France is Paris."
        )


HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>The user asks for France's capital: Paris.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Paris.<|return|>"
)
HARMONY_CASES = [
    (HARMONY_ANSWER, "The user asks for France's capital: Paris.", "Paris."),
    ("<|channel|>final<|message|>Paris.", "", "Paris."),
    ("<|channel|>analysis<|message|>still thinking", "still thinking", ""),
    ("Paris, plainly.", "", "Paris, plainly."),
]


@pytest.mark.parametrize("output, reasoning, content", HARMONY_CASES)
@pytest.mark.parametrize("size", [1, 2, 5, 13])
def test_harmony_channels_split_from_the_answer_wherever_the_tokens_cut(
    output: str, reasoning: str, content: str, size: int
) -> None:
    splitter, got = HarmonySplitter(), ["", ""]
    for at in range(0, len(output), size):
        r, c = splitter.feed(output[at : at + size])
        assert (
            "<|" not in r + c and "|>" not in r + c
        )  # no piece of a marker or header is ever shown
        got[0], got[1] = got[0] + r, got[1] + c
    r, c = splitter.flush()
    assert (got[0] + r, got[1] + c) == (reasoning, content)


def test_the_api_returns_harmonys_analysis_channel_as_reasoning_content() -> None:
    """gpt-oss's format: the analysis channel is reasoning, the final channel the content."""
    template = (
        "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
        "<|start|>assistant{# <|channel|> #}"
    )
    assert uses_harmony(template) and not uses_harmony("{{ messages }}")
    backend = Canned(LocalModel.load(), HARMONY_ANSWER, template)
    with serve(backend) as url:  # type: ignore[arg-type]
        client = client_for(url)
        ask = dict(
            model=NAME, messages=[{"role": "user", "content": "Capital of France?"}], max_tokens=96
        )
        message = client.chat.completions.create(**ask).choices[0].message  # type: ignore[call-overload]
        assert (
            message.content == "Paris."
            and message.model_extra["reasoning_content"]
            == "The user asks for France's capital: Paris."
        )
        chunks = [
            c.choices[0].delta
            for c in client.chat.completions.create(stream=True, **ask)
            if c.choices
        ]  # type: ignore[call-overload]
        assert "".join(d.content or "" for d in chunks) == "Paris."
