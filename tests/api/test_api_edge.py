"""What the API refuses or drops before it costs the server or the mesh, as a client meets it:
the real ``openai`` client and raw HTTP against real servers (uvicorn in this process, a
`seamline serve --single` process, a mesh's coordinator process).

- Whatever travels to the nodes is bounded: ``logit_bias`` entries, a schema's size, stop strings.
- Administration checks its key before it reads a body, and every route's body is capped.
- A large body is parsed, and its prompt tokenised, off the event loop and within bounded memory.
- A request whose client left before its first token is dropped, never prefilled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from seamline.app import LocalModel
from seamline.params import MAX_LOGIT_BIAS
from seamline.runtime.backend import LocalBackend
from seamline.server.bodies import encode_within
from tests.support.api import NAME, chat, client_for, serve, start_server, stop_server
from tests.support.mesh_harness import MeshProcesses
from tests.support.tools import TEMPLATES

MB = 1 << 20


def _refusal(caught: pytest.ExceptionInfo[openai.BadRequestError]) -> dict[str, Any]:
    body = caught.value.body
    assert caught.value.status_code == 400 and isinstance(body, dict), body
    return body


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/PID/status")


@contextmanager
def _rss_growth(pid: int) -> Iterator[list[float]]:
    """Samples the process's resident memory every 2 ms while the block runs; the list it
    yields then holds the most it grew over its level at the start, in MiB."""
    base, most, done = _rss_mb(pid), [0.0], threading.Event()

    def watch() -> None:
        while not done.wait(0.002):
            most[0] = max(most[0], _rss_mb(pid) - base)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    grown: list[float] = []
    try:
        yield grown
    finally:
        done.set()
        watcher.join()
        grown.append(most[0])


# --- what travels to the nodes is bounded ------------------------------------------------------


def test_logit_bias_schemas_and_stops_over_their_bounds_are_400s_naming_the_field(
    client: openai.OpenAI,
) -> None:
    fine = {str(t): 0.0 for t in range(1000, 1000 + MAX_LOGIT_BIAS)}
    answer = chat(client, temperature=0, max_tokens=4, logit_bias=fine)
    assert answer.choices[0].message.content  # 300 entries, OpenAI's bound, are taken
    huge = {str(t): 1.0 for t in range(100_000, 200_000)}  # ~1.7 MB of JSON
    for bias in ({**fine, "5": 1.0}, huge):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, max_tokens=4, logit_bias=bias)
        error = _refusal(caught)
        assert error["param"] == "logit_bias" and "300" in error["message"], error["message"][:200]
    big_schema = {"type": "object", "description": "x" * 1_200_000}
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": big_schema}}
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, max_tokens=4, response_format=response_format)
    assert _refusal(caught)["param"] == "response_format"
    tool = {"type": "function", "function": {"name": "f", "parameters": big_schema}}
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, max_tokens=4, tools=[tool])
    assert _refusal(caught)["param"] == "tools[0].function.parameters"
    for stop in (["x" * 1025], ["a", "b", "c", "d", "e"]):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, max_tokens=4, stop=stop)
        assert _refusal(caught)["param"] == "stop"


def test_a_required_tool_call_whose_grammar_is_too_large_is_a_400_naming_tools(
    model: LocalModel,
) -> None:
    """Two tools each within the schema bound, whose required call would compile to a grammar
    over the bound (it travels to the nodes with the request)."""
    codec = replace(
        model.codec, chat_template=(TEMPLATES / "hermes.jinja").read_text(), _template=None
    )
    schema = {"type": "object", "description": "x" * 60_000}
    tools = [
        {"type": "function", "function": {"name": name, "parameters": schema}}
        for name in ("a", "b")
    ]
    with serve(LocalBackend(model.engine, codec, NAME)) as url:
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client_for(url), max_tokens=4, tools=tools, tool_choice="required")
    error = _refusal(caught)
    assert error["param"] == "tools" and error["code"] == "grammar_too_large", error


def test_a_long_prompt_is_counted_in_pieces_and_tokenised_exactly_when_it_fits(
    model: LocalModel,
) -> None:
    codec = model.codec
    text = (
        "The quick brown fox jumps over the lazy dog.\nIt was the best of times. " * 4000
    )  # ~290k characters
    ids = codec.encode(text)
    assert encode_within(codec, text, len(ids)) == ids  # the count's cuts never refuse what fits
    assert encode_within(codec, text, len(ids) // 4) is None
    assert encode_within(codec, "x" * 5_000_000, 8191) is None  # one endless word: cut anywhere


# --- administration and body caps -------------------------------------------------------------


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcesses]:
    mesh = MeshProcesses(tmp_path_factory.mktemp("edge"), nodes=1, serve_args=("--context", "512"))
    mesh.start(join=False)  # the coordinator alone serves administration
    try:
        yield mesh
    finally:
        mesh.stop()


def test_administration_checks_its_key_before_reading_a_body_and_caps_it(
    coordinator: MeshProcesses,
) -> None:
    assert coordinator.serve is not None
    key = (coordinator.root / "coordinator" / "mesh" / "admin.key").read_text().strip()
    url = f"{coordinator.base_url}/api/admin/invites"
    json_type = {"Content-Type": "application/json"}

    def chunks(total: int) -> Iterator[bytes]:  # no Content-Length: streamed as it is made
        yield b'{"uses": 1, "pad": "'
        for _ in range(total // MB):
            yield b"x" * MB
        yield b'"}'

    httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=30).raise_for_status()
    with _rss_growth(coordinator.serve.pid) as grown:
        wrong = httpx.post(
            url,
            content=chunks(50 * MB),
            headers={**json_type, "Authorization": "Bearer guess"},
            timeout=60,
        )
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
    assert wrong.json()["error"]["code"] == "invalid_admin_key"
    assert grown[0] < 8, f"a refused 50 MB body grew the server by {grown[0]:.1f} MiB"
    admin = {**json_type, "Authorization": f"Bearer {key}"}
    for body in (chunks(MB), b'{"uses": 1, "pad": "' + b"x" * 100_000 + b'"}'):
        over = httpx.post(url, content=body, headers=admin, timeout=60)
        assert over.status_code == 413 and over.json()["error"]["code"] == "body_too_large"
    made = httpx.post(
        url,
        json={"uses": 1, "expires_s": 60},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert made.status_code == 200 and made.json()["token"].startswith("seamline-")
    fragments = httpx.request(
        "GET", f"{coordinator.base_url}/fragments/manifest.json", content=b"x" * 100_000
    )
    assert fragments.status_code == 413  # an open route's body is capped too


# --- large bodies off the event loop ----------------------------------------------------------


def test_an_administrator_holds_the_plan_and_releases_it(coordinator: MeshProcesses) -> None:
    key = (coordinator.root / "coordinator" / "mesh" / "admin.key").read_text().strip()
    url, admin = f"{coordinator.base_url}/api/admin/balance", {"Authorization": f"Bearer {key}"}
    assert coordinator.status()["balance_held"] is False
    assert httpx.put(url, json={"hold": True}, timeout=30).status_code == 401
    for bad, named in (
        ({"hold": "maybe"}, "hold"),
        ({"hold": True, "for": 3}, "for"),
        ({}, "hold"),
    ):
        refused = httpx.put(url, json=bad, headers=admin, timeout=30)
        assert refused.status_code == 400 and named in refused.json()["error"]["message"], (
            refused.text
        )
    held = httpx.put(url, json={"hold": True}, headers=admin, timeout=30)
    assert (
        held.status_code == 200
        and held.json()["hold"] is True
        and coordinator.status()["balance_held"] is True
    )
    httpx.put(url, json={"hold": False}, headers=admin, timeout=30).raise_for_status()
    assert coordinator.status()["balance_held"] is False


def test_health_answers_while_a_15_mb_prompt_is_parsed_and_memory_stays_bounded(
    tmp_path: Path,
) -> None:
    proc, url = start_server(tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        client.completions.create(model="default", prompt="Hello", max_tokens=1)  # warm
        prompt = ("The quick brown fox jumps over the lazy dog. " * 340_000)[:15_000_000]
        outcomes: list[str] = []

        def ask(chat_too: bool) -> None:
            with pytest.raises(openai.BadRequestError) as caught:
                if chat_too:
                    client.chat.completions.create(
                        model="default", messages=[{"role": "user", "content": prompt}]
                    )
                else:
                    client.completions.create(model="default", prompt=prompt, max_tokens=1)
            outcomes.append(_refusal(caught)["code"])

        askers = [threading.Thread(target=ask, args=(i % 2 == 1,)) for i in range(4)]
        slowest, polls = 0.0, 0
        with _rss_growth(proc.pid) as grown:
            for asker in askers:
                asker.start()
            while any(a.is_alive() for a in askers):
                started = time.monotonic()
                assert httpx.get(f"{url}/health", timeout=30).status_code == 200
                slowest, polls = max(slowest, time.monotonic() - started), polls + 1
                time.sleep(0.02)
        print(
            f"four 15 MB prompts: /health at most {slowest:.3f} s ({polls} polls); RSS +{grown[0]:.0f} MiB at most"
        )
        assert outcomes == ["context_length_exceeded"] * 4
        assert slowest < 1.0, f"/health took {slowest:.2f} s while large prompts were parsed"
        assert grown[0] < 250, f"four 15 MB prompts grew the server's memory by {grown[0]:.0f} MiB"
    finally:
        stop_server(proc)


# --- a client that left before its first token ------------------------------------------------


def test_a_request_abandoned_before_its_first_token_is_dropped_unprefilled(
    model: LocalModel,
) -> None:
    """One running slot, held by a long stream: two more requests (one streaming) wait in the
    queue; their clients give up. They leave the queue at once, and never draw a token."""
    backend = LocalBackend(model.engine, model.codec, NAME, max_running=1)
    scheduler = backend.loop.scheduler
    with serve(backend) as base:
        holder = chat(
            client_for(base),
            temperature=0,
            max_tokens=8000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(holder))  # it holds the one slot
        impatient = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=1.5)
        for stream in (False, True):
            with pytest.raises(openai.APITimeoutError):
                chat(
                    impatient,
                    [{"role": "user", "content": f"Question {stream}"}],
                    max_tokens=5,
                    stream=stream,
                )
        deadline = time.monotonic() + 2
        while scheduler.waiting and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not scheduler.waiting, "requests whose clients left still wait for the running slot"
        assert len(scheduler.running) == 1
        holder.close()
        deadline = time.monotonic() + 10
        while not scheduler.idle and time.monotonic() < deadline:
            time.sleep(0.02)
        metrics = httpx.get(f"{base}/metrics").text
    first_tokens = next(
        line
        for line in metrics.splitlines()
        if line.startswith("seamline_time_to_first_token_seconds_count")
    )
    assert first_tokens.endswith(" 1.0"), (
        first_tokens
    )  # the holder's only: the abandoned never drew one
    assert 'seamline_requests_total{status="abort"} 3.0' in metrics
    assert "seamline_requests_waiting 0.0" in metrics


def test_a_template_that_fails_to_render_is_a_400_naming_its_error(model: LocalModel) -> None:
    codec = replace(
        model.codec, chat_template="{{ messages[0].content | nosuchfilter }}", _template=None
    )
    with serve(LocalBackend(model.engine, codec, NAME)) as url:
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client_for(url), max_tokens=4)
    error = _refusal(caught)
    assert error["param"] == "messages" and "nosuchfilter" in error["message"], error


def test_a_requests_template_variables_reach_the_template(model: LocalModel) -> None:
    """``documents``, ``reasoning_effort`` and ``chat_template_kwargs`` as Hugging Face passes
    them; ``enable_thinking`` true unless asked otherwise, as llama-server passes it."""
    shown = (
        "{% for m in messages %}{{ m.content }}{% endfor %}|{{ reasoning_effort }}"
        "|{{ enable_thinking }}|{{ documents | length if documents else 0 }}|{{ flavour }}"
    )
    codec = replace(model.codec, chat_template=shown, _template=None)
    with serve(LocalBackend(model.engine, codec, NAME)) as url:
        client = client_for(url)
        plain = chat(client, max_tokens=1, logprobs=False)
        asked = chat(
            client,
            max_tokens=1,
            reasoning_effort="high",
            extra_body={
                "documents": [{"title": "a", "text": "b"}],
                "chat_template_kwargs": {"enable_thinking": False, "flavour": "x"},
            },
        )
    text = "What is the capital of France?"
    assert plain.usage is not None and asked.usage is not None
    assert plain.usage.prompt_tokens == len(codec.encode_chat_text(f"{text}||True|0|"))
    assert asked.usage.prompt_tokens == len(codec.encode_chat_text(f"{text}|high|False|1|x"))
