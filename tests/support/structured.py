"""Greedy answers under a JSON schema."""

from __future__ import annotations

from seamline.app import LocalModel
from seamline.params import SamplingParams
from seamline.server.grammars import GrammarCheck
from seamline.server.openai_schema import ResponseFormat

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}

ASK = [{"role": "user", "content": "Describe a person as JSON."}]


SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}


def greedy_under_schema(model: LocalModel, tokens: int) -> tuple[str, list[int], SamplingParams]:
    """The one process's greedy answer under ``SCHEMA_FORMAT`` (the splits' tests in
    test_api_sampling.py compare theirs with it), its prompt and its parameters."""
    grammar = GrammarCheck(model.codec).response_format(
        ResponseFormat.model_validate(SCHEMA_FORMAT)
    )
    params = SamplingParams(
        max_tokens=tokens, grammar=grammar, stop_token_ids=tuple(model.codec.stop_ids)
    )
    prompt = model.codec.encode_chat(ASK)
    return model.codec.decode(list(model.engine.generate(prompt, params))), prompt, params
