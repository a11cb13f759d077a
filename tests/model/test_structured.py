"""``response_format``: JSON answers by constrained decoding (llguidance), through the real
openai client and a real server on the embedded model. A schema with bounded lengths always
gets an answer that parses, validates and ends with finish_reason "stop"; a schema that cannot
be compiled is a 400 naming the field. (A 2-stage mesh and a 2-rank lockstep group answer
under a schema as the one process does: test_api_sampling.py, beside the other ways the last
stage draws.)"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import jsonschema
import openai
import pytest
import torch

from seamline.app import LocalModel
from seamline.runtime.grammar import TokenMasks
from seamline.server.grammars import GrammarCheck
from seamline.server.openai_schema import ResponseFormat
from tests.support.api import NAME
from tests.support.structured import ASK, PERSON, SCHEMA_FORMAT, greedy_under_schema


def test_json_schema_answers_parse_validate_and_stop_at_temperature_1(
    client: openai.OpenAI,
) -> None:
    """50 sampled answers (5 concurrent requests of n=10, batched together): every one is a
    valid person, ended by "stop"."""

    def ask(seed: int) -> list[Any]:
        reply = client.chat.completions.create(
            model=NAME,
            messages=ASK,
            temperature=1.0,
            seed=seed,
            n=10,  # type: ignore[arg-type]
            max_tokens=200,
            response_format=SCHEMA_FORMAT,
        )  # type: ignore[arg-type]
        return list(reply.choices)

    with ThreadPoolExecutor(5) as pool:
        answers = [choice for choices in pool.map(ask, range(5)) for choice in choices]
    assert len(answers) == 50
    texts = set()
    for choice in answers:
        assert choice.finish_reason == "stop", choice
        person = json.loads(choice.message.content or "")
        jsonschema.validate(person, PERSON)
        texts.add(choice.message.content)
    assert len(texts) > 10  # sampled, not one answer forced


def test_json_object_is_an_object_and_a_stream_carries_it(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=NAME,
        messages=ASK,
        temperature=0,
        max_tokens=120,
        response_format={"type": "json_object"},
    )
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:  # an open object may run to max_tokens; what came is an object's start
        assert (choice.message.content or "").startswith("{")
    stream = client.chat.completions.create(
        model=NAME,
        messages=ASK,
        temperature=0,
        max_tokens=200,
        stream=True,
        response_format=SCHEMA_FORMAT,
    )  # type: ignore[arg-type]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    "schema, fragment",
    [
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}, "regex"),
        ({"type": "nonsense"}, "nonsense"),
        ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
        # $refs that only point at each other: no answer can match (it answered "" and "stop")
        ({"$ref": "#"}, "cycle"),
        (
            {
                "$ref": "#/$defs/a",
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
            },
            "cycle",
        ),
        ({"anyOf": [{"$ref": "#"}]}, "cycle"),
    ],
)
def test_a_schema_that_cannot_compile_is_a_400_naming_the_field(
    client: openai.OpenAI, schema: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=NAME,
            messages=ASK,
            max_tokens=4,
            response_format={  # type: ignore[arg-type]
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            },
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "response_format.json_schema.schema", error
    assert fragment in error["message"], error


def test_an_unknown_response_format_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=NAME, messages=ASK, max_tokens=4, response_format={"type": "yaml"}
        )  # type: ignore[arg-type,typeddict-item]
    assert isinstance(caught.value.body, dict) and caught.value.body["param"].startswith(
        "response_format"
    )


def test_a_matcher_follows_the_output_it_is_given_replays_included(model: LocalModel) -> None:
    """The sampling site feeds each draw the output so far: a sequence replayed or preempted
    (its output shorter, or different) gets a matcher rebuilt from its tokens."""
    expected, _, params = greedy_under_schema(model, 120)
    output = model.codec.encode(expected)
    masks, vocab = TokenMasks(model.codec.tokenizer.to_str), model.config.vocab_size
    after_all = masks.allowed("seq", params, output, vocab)
    assert after_all is not None and set(after_all.nonzero().flatten().tolist()) == set(
        params.stop_token_ids
    )
    middle = masks.allowed("seq", params, output[:5], vocab)  # replayed from an earlier point
    assert (
        middle is not None
        and bool(middle[output[5]])
        and not bool(middle[params.stop_token_ids[0]])
    )
    assert torch.equal(masks.allowed("seq", params, output, vocab), after_all)  # type: ignore[arg-type]
    other = replace(
        params,
        grammar=GrammarCheck(model.codec).response_format(ResponseFormat(type="json_object")),
    )
    switched = masks.allowed("seq", other, output[:1], vocab)  # a new grammar, a new matcher
    fresh = TokenMasks(model.codec.tokenizer.to_str).allowed("fresh", other, output[:1], vocab)
    assert switched is not None and torch.equal(switched, fresh)  # type: ignore[arg-type]
    assert not torch.equal(switched, masks.allowed("seq", params, output[:1], vocab))  # type: ignore[arg-type]
