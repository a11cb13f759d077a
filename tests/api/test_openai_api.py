"""The OpenAI API as a client sees it: the real ``openai`` client against a real uvicorn server.

Generation runs on the embedded SmolLM2 through LocalBackend. Small wrappers around that
backend stand in only for what the engine cannot do on demand: not being ready, failing
mid-stream, and reporting that a cancelled request's iterator was closed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from seamline.app import LocalModel
from seamline.errors import SeamlineError
from seamline.params import SamplingParams
from seamline.runtime.backend import LocalBackend, Readiness
from seamline.runtime.sampling import TokenEvent
from tests.support.api import NAME, QUESTION, chat, client_for, serve


@pytest.fixture(scope="module")
def model() -> LocalModel:
    return LocalModel.load()


@pytest.fixture(scope="module")
def backend(model: LocalModel) -> LocalBackend:
    return LocalBackend(model.engine, model.codec, NAME)


@pytest.fixture(scope="module")
def url(backend: LocalBackend) -> Iterator[str]:
    with serve(backend) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return client_for(url)


@pytest.fixture(scope="module")
def paris(client: openai.OpenAI) -> Any:
    """The greedy, non-streaming answer to the capital question."""
    return chat(client, temperature=0, max_tokens=32)


# --- generation -----------------------------------------------------------------------------


def test_chat_answers_paris_with_exact_usage(paris: Any, model: LocalModel) -> None:
    prompt = model.codec.encode_chat(QUESTION)
    params = SamplingParams(max_tokens=32, stop_token_ids=model.codec.stop_ids)
    expected = list(model.engine.generate(prompt, params))
    choice = paris.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert choice.message.content == model.codec.decode(expected)
    assert paris.usage.prompt_tokens == len(prompt)
    assert paris.usage.completion_tokens == len(expected)
    assert paris.usage.total_tokens == len(prompt) + len(expected)
    assert (
        paris.object == "chat.completion"
        and paris.model == NAME
        and paris.id.startswith("chatcmpl-")
    )


def test_chat_stream_equals_non_streaming(client: openai.OpenAI, paris: Any) -> None:
    usage = {"include_usage": True}
    chunks = list(chat(client, temperature=0, max_tokens=32, stream=True, stream_options=usage))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == paris.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == paris.usage.model_dump()
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_max_tokens_ends_with_length(client: openai.OpenAI) -> None:
    out = chat(client, temperature=0, max_tokens=5)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 5


def test_stop_string_cuts_the_answer(client: openai.OpenAI) -> None:
    out = chat(client, temperature=0, max_tokens=32, stop=["Paris"])
    text = str(out.choices[0].message.content)
    assert "Paris" not in text and "France" in text
    assert out.choices[0].finish_reason == "stop"


def test_same_seed_same_sample(client: openai.OpenAI) -> None:
    def ask() -> str:
        out = chat(client, temperature=1.0, seed=1234, max_tokens=8)
        return str(out.choices[0].message.content)

    first = ask()
    assert first and ask() == first


def test_n_choices_each_a_sequence_of_its_own(client: openai.OpenAI, paris: Any) -> None:
    """n=3 seeded: three choices with their indexes, choice i is the n=1 answer with seed + i;
    the prompt is counted once in usage; the stream gives the same texts per index; greedy
    choices are all the greedy answer."""
    many = chat(client, temperature=1.0, seed=40, max_tokens=12, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    completion = 0
    for i, choice in enumerate(many.choices):
        alone = chat(client, temperature=1.0, seed=40 + i, max_tokens=12)
        assert choice.message.content == alone.choices[0].message.content
        assert choice.finish_reason == alone.choices[0].finish_reason
        completion += alone.usage.completion_tokens
    assert many.usage.prompt_tokens == paris.usage.prompt_tokens
    assert many.usage.completion_tokens == completion
    texts, finishes = ["", "", ""], [None, None, None]
    for chunk in chat(client, temperature=1.0, seed=40, max_tokens=12, n=3, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.message.content for c in many.choices]
    assert finishes == [c.finish_reason for c in many.choices]
    greedy = chat(client, temperature=0, max_tokens=32, n=2)
    assert [c.message.content for c in greedy.choices] == [paris.choices[0].message.content] * 2


def test_ignore_eos_generates_max_tokens(client: openai.OpenAI, paris: Any) -> None:
    """The capital answer stops early by itself; with ignore_eos it runs to max_tokens."""
    assert paris.usage.completion_tokens < 32
    reply = chat(client, temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 40 and reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content.startswith(paris.choices[0].message.content)


def test_top_k_extension_is_honoured(client: openai.OpenAI, paris: Any) -> None:
    # top_k=1 leaves only the most likely token: sampling at temperature 1 becomes greedy.
    out = chat(client, temperature=1.0, max_tokens=32, extra_body={"top_k": 1, "min_p": 0.05})
    assert out.choices[0].message.content == paris.choices[0].message.content


def test_text_parts_and_developer_role_render_like_strings(
    client: openai.OpenAI, paris: Any
) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}]
    out = chat(client, parts, temperature=0, max_tokens=1)
    assert out.usage is not None and out.usage.prompt_tokens == paris.usage.prompt_tokens
    dev = [{"role": "developer", "content": "Be brief."}, *QUESTION]
    sys = [{"role": "system", "content": "Be brief."}, *QUESTION]
    a = chat(client, dev, model="default", temperature=0, max_tokens=1)
    b = chat(client, sys, temperature=0, max_tokens=1)
    assert (
        a.usage is not None
        and b.usage is not None
        and a.usage.prompt_tokens == b.usage.prompt_tokens
    )
    assert a.model == NAME  # the alias answers with the real name


def test_completions_streaming_and_not(client: openai.OpenAI, model: LocalModel) -> None:
    prompt = "The capital of France is"
    full = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=6)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert full.choices[0].finish_reason == "length" and "Paris" in full.choices[0].text
    assert full.usage is not None and full.usage.prompt_tokens == len(model.codec.encode(prompt))
    assert full.usage.completion_tokens == 6
    streamed = client.completions.create(
        model=NAME,
        prompt=prompt,
        temperature=0,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    ids = model.codec.encode(prompt)
    echoed = client.completions.create(
        model=NAME, prompt=ids, temperature=0, max_tokens=6, echo=True
    )
    assert echoed.choices[0].text == prompt + full.choices[0].text


def test_models_and_health(client: openai.OpenAI, url: str) -> None:
    listed = client.models.list().data
    assert [m.id for m in listed] == [NAME]
    assert listed[0].object == "model" and listed[0].owned_by == "seamline"
    assert client.models.retrieve(NAME).id == NAME
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


class Scripted:
    """A backend that yields fixed events, as an engine whose context filled early would."""

    def __init__(self, real: LocalBackend, events: list[TokenEvent]) -> None:
        self.model_name, self.codec, self.context_length = (
            real.model_name,
            real.codec,
            real.context_length,
        )
        self.events = events

    def readiness(self) -> Readiness:
        return Readiness(True)

    async def generate(
        self, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        for event in self.events:
            yield event


def test_the_finish_reason_is_the_backends_and_a_stop_token_is_not_output(
    backend: LocalBackend,
) -> None:
    """The API reports why a request ended as the backend's last event says (here "length"
    after 3 of 40 tokens, as at a full context), never worked out again from its own count; a
    stop token ends the text without being in it or counted."""
    words = backend.codec.encode(" Paris is big")
    ended = [*(TokenEvent(t) for t in words[:-1]), TokenEvent(words[-1], finish_reason="length")]
    stopped = [
        *(TokenEvent(t) for t in words),
        TokenEvent(backend.codec.stop_ids[0], finish_reason="stop"),
    ]
    for events, reason in ((ended, "length"), (stopped, "stop")):
        with serve(Scripted(backend, events)) as base:  # type: ignore[arg-type]
            client = client_for(base)
            reply = chat(client, max_tokens=40)
            streamed = [c.choices[0] for c in chat(client, max_tokens=40, stream=True) if c.choices]
        assert reply.choices[0].finish_reason == reason and streamed[-1].finish_reason == reason
        assert reply.choices[0].message.content == backend.codec.decode(words)
        assert reply.usage.completion_tokens == len(words)
        assert "".join(c.delta.content or "" for c in streamed) == reply.choices[0].message.content


# --- errors -----------------------------------------------------------------------------------


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.body
    assert isinstance(body, dict), body  # the client unwraps {"error": {...}}
    return body


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        chat(client, QUESTION, model="gpt-4o")
    assert info.value.status_code == 404
    err = _error(info.value)
    assert err["code"] == "model_not_found" and err["param"] == "model" and NAME in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"extra_body": {"top_k": "5"}}, "top_k"),
    ],
)
def test_bad_fields_are_400_naming_the_field(
    client: openai.OpenAI, fields: Any, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **fields)
    assert info.value.status_code == 400
    err = _error(info.value)
    assert (
        err["param"] == param and err["type"] == "invalid_request_error" and param in err["message"]
    )


def test_missing_messages_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=openai.omit)  # type: ignore[call-overload]
    err = _error(info.value)
    assert err["param"] == "messages" and err["code"] == "missing_required_parameter"


def test_malformed_json_is_400_in_openai_format(url: str) -> None:
    json_type = {"Content-Type": "application/json"}
    reply = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": ', headers=json_type)
    assert reply.status_code == 400
    err = reply.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
    assert "JSON" in err["message"]
    form = httpx.post(
        f"{url}/v1/chat/completions", content=b"{}", headers={"Content-Type": "text/plain"}
    )
    assert (
        form.status_code == 400
        and "Content-Type: application/json" in form.json()["error"]["message"]
    )
    missing = httpx.get(f"{url}/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_prompt_longer_than_context_is_400(client: openai.OpenAI, backend: LocalBackend) -> None:
    long = [{"role": "user", "content": "word " * backend.context_length}]
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, long, temperature=0, max_tokens=1)
    err = _error(info.value)
    assert (
        err["code"] == "context_length_exceeded" and str(backend.context_length) in err["message"]
    )
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=NAME, prompt="hi", max_tokens=backend.context_length, stream=True
        )
    assert _error(info.value)["param"] == "max_tokens"


# --- readiness, failure, cancellation ----------------------------------------------------------


class NotReady:
    """Has the real codec but is still loading: must never be asked to generate."""

    def __init__(self, real: LocalBackend) -> None:
        self.model_name, self.codec, self.context_length = (
            real.model_name,
            real.codec,
            real.context_length,
        )

    def readiness(self) -> Readiness:
        return Readiness(False, "loading layers 12/30")

    def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[int]:
        raise AssertionError("generate called on a backend that is not ready")


class Wrapped:
    """The real backend, raising ``error`` after ``fail_after`` tokens; notes when its iterator closes."""

    def __init__(
        self, real: LocalBackend, fail_after: int | None = None, error: Exception | None = None
    ) -> None:
        self.real, self.fail_after = real, fail_after
        self.error = error or SeamlineError("stage 2 stopped answering")
        self.model_name, self.codec, self.context_length = (
            real.model_name,
            real.codec,
            real.context_length,
        )
        self.closed = threading.Event()
        self.tokens = 0
        self.ran_out = False  # the inner iterator ended by itself (not closed early)

    def readiness(self) -> Readiness:
        return self.real.readiness()

    async def generate(
        self, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        self.closed.clear()
        inner = self.real.generate(prompt, params)
        try:
            async for token in inner:
                if self.fail_after is not None and self.tokens >= self.fail_after:
                    raise self.error
                self.tokens += 1
                yield token
            self.ran_out = True
        finally:
            await inner.aclose()  # type: ignore[attr-defined]
            self.closed.set()


def test_not_ready_is_503_with_reason(backend: LocalBackend) -> None:
    with serve(NotReady(backend)) as base:
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503
        assert health.json() == {"status": "not ready", "reason": "loading layers 12/30"}
        with pytest.raises(openai.InternalServerError) as info:
            chat(client_for(base), temperature=0)
        assert info.value.status_code == 503
        err = _error(info.value)
        assert err["type"] == "service_unavailable" and "loading layers 12/30" in err["message"]


def test_backend_failure_is_an_error_not_a_hang(backend: LocalBackend) -> None:
    failing = Wrapped(backend, fail_after=2)
    with serve(failing) as base:
        client = client_for(base)
        with pytest.raises(openai.APIError) as streamed:
            for _ in chat(client, temperature=0, stream=True):
                pass
        assert "stage 2 stopped answering" in streamed.value.message
        failing.tokens = 0
        with pytest.raises(openai.InternalServerError) as whole:
            chat(client, temperature=0)
        assert whole.value.status_code == 503 and "stage 2 stopped answering" in whole.value.message
        failing.tokens, failing.error = 0, ZeroDivisionError("a bug")
        reply = httpx.post(
            f"{base}/v1/chat/completions", json={"model": NAME, "messages": QUESTION}
        )
        assert reply.status_code == 500 and "Traceback" not in reply.text
        assert (
            reply.json()["error"]["type"] == "server_error"
            and "a bug" in reply.json()["error"]["message"]
        )


COUNTING = "1, 2, 3, 4, 5, 6,"  # greedy SmolLM2 keeps counting: a generation that would run long


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_generation(backend: LocalBackend, stream: bool) -> None:
    tracked = Wrapped(backend)
    body = {
        "model": NAME,
        "prompt": COUNTING,
        "temperature": 0,
        "max_tokens": 4000,
        "stream": stream,
    }
    with (
        serve(tracked) as base,
        httpx.Client(base_url=base, timeout=httpx.Timeout(10, read=2)) as http,
    ):
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as reply:
                for _ in reply.iter_lines():
                    if tracked.tokens >= 3:
                        break  # the client leaves mid-stream
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=body)  # the client gives up waiting
        assert tracked.closed.wait(timeout=15), (
            "the backend iterator was not closed after the client left"
        )
        assert not tracked.ran_out and tracked.tokens < 4000
        deadline = time.monotonic() + 1.0  # its sequence and KV cache are freed within a second
        while not backend.loop.scheduler.idle and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend.loop.scheduler.idle, "the abandoned sequence still holds a cache"
        after = client_for(base).completions.create(
            model=NAME, prompt=COUNTING, temperature=0, max_tokens=3
        )
        assert after.usage is not None and after.usage.completion_tokens == 3


# --- concurrency ------------------------------------------------------------------------------


def test_concurrent_requests_share_steps_and_answer_as_alone(
    client: openai.OpenAI, backend: LocalBackend, model: LocalModel
) -> None:
    """Six clients at once, different prompts and lengths: each gets the text its request gets
    alone (greedy), and the batch loop ran some of them in the same steps."""
    questions = [
        "What is the capital of France?",
        "Name a red fruit.",
        "Count to five.",
        "What colour is the sky?",
        "Say hello in Spanish.",
        "What is two plus two?",
    ]
    steps_before = backend.loop.scheduler.stage.step
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        reply = chat(
            client,
            [{"role": "user", "content": questions[i]}],
            temperature=0,
            max_tokens=12 + 2 * i,
        )
        answers[i] = reply.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    steps = backend.loop.scheduler.stage.step - steps_before
    for i, question in enumerate(questions):
        prompt = model.codec.encode_chat([{"role": "user", "content": question}])
        alone = model.engine.generate(
            prompt, SamplingParams(max_tokens=12 + 2 * i, stop_token_ids=model.codec.stop_ids)
        )
        assert answers[i] == model.codec.decode(list(alone)), question
    assert steps < sum(12 + 2 * i for i in range(len(questions))), (
        "the requests took turns instead of sharing steps"
    )


def test_a_full_queue_is_429_and_the_server_keeps_serving(model: LocalModel) -> None:
    """One request runs, one waits (the limits are 1 and 1): a third is refused with 429 in
    OpenAI's format; when the first leaves, the waiting one is served."""
    small = LocalBackend(model.engine, model.codec, NAME, max_running=1, max_waiting=1)
    scheduler = small.loop.scheduler
    with serve(small) as base:
        client = client_for(base)
        running = chat(
            client, temperature=0, max_tokens=300, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(running))  # it holds the one running slot
        waited: list[Any] = []
        waiter = threading.Thread(
            target=lambda: waited.append(chat(client, temperature=0, max_tokens=4))
        )
        waiter.start()
        deadline = time.monotonic() + 30
        while len(scheduler.waiting) < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as info:
            chat(client, temperature=0, max_tokens=4)
        err = _error(info.value)
        assert (
            info.value.status_code == 429
            and err["code"] == "queue_full"
            and "waiting" in err["message"]
        )
        running.close()  # the first client leaves: the waiting request takes its place
        waiter.join(timeout=60)
        assert waited and waited[0].usage.completion_tokens == 4


def test_prompts_are_tokenized_off_the_event_loop(backend: LocalBackend) -> None:
    """Rendering and tokenizing a prompt run where no event loop runs (a worker thread), so a
    large one never stalls /health or other streams on the server's loop."""

    def on_event_loop() -> bool:
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            return False

    class Recording:
        def __init__(self, codec: Any) -> None:
            self.codec, self.on_loop = codec, []

        def __getattr__(self, name: str) -> Any:
            return getattr(self.codec, name)

        def encode(self, text: str) -> list[int]:
            self.on_loop.append(on_event_loop())
            return self.codec.encode(text)

        def encode_chat(self, messages: Any) -> list[int]:
            self.on_loop.append(on_event_loop())
            return self.codec.encode_chat(messages)

    wrapped = Wrapped(backend)
    recording = Recording(backend.codec)
    wrapped.codec = recording  # type: ignore[assignment]
    with serve(wrapped) as base:
        client = client_for(base)
        chat(client, temperature=0, max_tokens=2)
        client.completions.create(model=NAME, prompt="Hello", temperature=0, max_tokens=2)
    assert recording.on_loop == [False, False]
