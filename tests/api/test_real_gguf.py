"""The real Gemma 3 270M GGUF that llama.cpp's converter wrote, served and asked through the
real ``openai`` client: the prompt gets BOS as the file says, token-id prompts are taken as
given, and the raw answer is llama-server's and transformers' (it was garbage without BOS)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support.api import client_for, start_server, stop_server
from tests.support.llama_cpp import gemma3_270m
from tests.support.real_gemma import ANSWER, PROMPT, PROMPT_IDS


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    tmp = tmp_path_factory.mktemp("gemma")
    proc, url = start_server(tmp, "--model", str(gemma3_270m()), "--speculative", "off")
    try:
        yield client_for(url)
    finally:
        stop_server(proc)


def _complete(client: openai.OpenAI, prompt: str | list[int]) -> openai.types.Completion:
    return client.completions.create(
        model="gemma-3-270m-q4_k_m", prompt=prompt, max_tokens=16, temperature=0
    )


def test_a_text_prompt_gets_bos_and_answers_as_llama_server(client: openai.OpenAI) -> None:
    reply = _complete(client, PROMPT)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(PROMPT_IDS)
    assert reply.choices[0].text == ANSWER


def test_token_id_prompts_are_taken_as_given(client: openai.OpenAI) -> None:
    with_bos = _complete(client, PROMPT_IDS)
    assert with_bos.usage is not None and with_bos.usage.prompt_tokens == len(PROMPT_IDS)
    assert with_bos.choices[0].text == ANSWER
    without = _complete(client, PROMPT_IDS[1:])
    assert without.usage is not None and without.usage.prompt_tokens == len(PROMPT_IDS) - 1
    assert without.choices[0].text != ANSWER  # no BOS added: the answer without it


def test_a_chat_is_rendered_in_gemmas_turns(client: openai.OpenAI) -> None:
    """The file has no template: Gemma's own turns, one BOS first (2 + the turns' ids)."""
    reply = client.chat.completions.create(
        model="gemma-3-270m-q4_k_m",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
    )
    # <bos> <start_of_turn> user \n Hi <end_of_turn> \n <start_of_turn> model \n
    assert reply.usage is not None and reply.usage.prompt_tokens == 10
