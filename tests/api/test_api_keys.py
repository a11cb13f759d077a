"""API keys, request limits and HTTPS, as a client meets them: `seamline serve --single` as a
real process, the real `openai` client and raw HTTP against it."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from seamline.net.link import free_port
from seamline.server.demo import memory_cap_gb
from tests.support.api import start_server, stop_server
from tests.support.mesh_harness import seamline_cmd

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ARGV_KEY, FILE_KEY, ENV_KEY = "key-from-argv", "key-from-file", "key-from-env"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("keys")
    (tmp / "keys.txt").write_text(f"# one key per line\n{FILE_KEY}\n\n")
    proc, url = start_server(
        tmp,
        "--api-key",
        ARGV_KEY,
        "--api-key-file",
        str(tmp / "keys.txt"),
        "--max-prompt-tokens",
        "60",
        "--max-concurrent-per-key",
        "1",
        "--max-body-mb",
        "0.01",
        env_key=ENV_KEY,
    )
    try:
        yield url
    finally:
        stop_server(proc)


def _client(url: str, key: str, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120, **kwargs)  # type: ignore[arg-type]


def _ask(client: openai.OpenAI, **fields: object) -> str:
    reply = client.chat.completions.create(
        model="default", messages=QUESTION, temperature=0, max_tokens=12, **fields
    )  # type: ignore[call-overload]
    return str(reply.choices[0].message.content)


def test_a_missing_or_wrong_key_is_refused_with_401_in_openai_format(server: str) -> None:
    body = {"model": "default", "messages": QUESTION}
    for headers in (
        {},
        {"Authorization": ARGV_KEY},
        {"Authorization": "Basic abc"},
    ):  # none, no scheme, another scheme
        reply = httpx.post(f"{server}/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key", (
            headers
        )
    for key in ("not-a-key", ARGV_KEY + "x"):
        with pytest.raises(openai.AuthenticationError) as refused:
            _ask(_client(server, key))
        assert refused.value.status_code == 401
        error = refused.value.body
        assert (
            isinstance(error, dict)
            and error["code"] == "invalid_api_key"
            and "--api-key" in error["message"]
        )
    for path in ("/v1/models", "/docs", "/openapi.json"):
        reply = httpx.get(f"{server}{path}", timeout=10)
        assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer", path
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200  # open, for load balancers


def test_keys_from_argv_a_file_and_the_environment_are_each_accepted(server: str) -> None:
    for key in (ARGV_KEY, FILE_KEY, ENV_KEY):
        assert "Paris" in _ask(_client(server, key)), key
    headers = {"Authorization": f"Bearer {FILE_KEY}"}
    assert httpx.get(f"{server}/docs", headers=headers, timeout=10).status_code == 200


def test_limits_on_body_prompt_and_requests_in_flight_are_clear_errors(server: str) -> None:
    headers = {"Authorization": f"Bearer {ARGV_KEY}"}
    big = {"model": "default", "messages": [{"role": "user", "content": "x" * 20000}]}
    reply = httpx.post(f"{server}/v1/chat/completions", json=big, headers=headers, timeout=30)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds as the body arrives
        yield b'{"model": "default", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 1000
        yield b'"}]}'

    reply = httpx.post(
        f"{server}/v1/chat/completions",
        content=chunks(),
        timeout=30,
        headers={**headers, "Content-Type": "application/json"},
    )
    assert reply.status_code == 413
    with pytest.raises(openai.BadRequestError) as long_prompt:
        _client(server, ARGV_KEY).chat.completions.create(
            model="default", messages=[{"role": "user", "content": "word " * 100}], max_tokens=4
        )
    assert long_prompt.value.code == "prompt_too_long" and "--max-prompt-tokens" in str(
        long_prompt.value
    )
    _one_in_flight_per_key(server)


def _one_in_flight_per_key(server: str) -> None:
    """While a stream holds the key's one slot, a second request with that key gets 429 and
    one with another key is answered; once the stream ends, the key is admitted again."""
    streaming = _client(server, ARGV_KEY).chat.completions.create(
        model="default",
        messages=QUESTION,
        max_tokens=200,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(streaming))
    assert first.choices
    with pytest.raises(openai.RateLimitError) as busy:
        _ask(_client(server, ARGV_KEY))
    assert busy.value.code == "concurrency_limit"
    assert "Paris" in _ask(_client(server, FILE_KEY))
    for _ in streaming:
        pass
    assert "Paris" in _ask(_client(server, ARGV_KEY))


def _trust(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cert)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_key_options_that_cannot_work_are_refused_at_start(tmp_path: Path) -> None:
    for args, fragment in (
        (("--ssl-certfile", "x.pem"), "go together"),
        (("--api-key-file", str(tmp_path / "missing")), "cannot read an API key file"),
    ):
        out = subprocess.run(
            seamline_cmd("serve", "--single", "--port", str(free_port()), *args),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode != 0 and fragment in out.stderr and "Traceback" not in out.stderr, (
            out.stderr
        )


def test_a_mesh_over_https_with_a_key(tmp_path: Path) -> None:
    """A two-node mesh whose API is HTTPS (--ssl-certfile/--ssl-keyfile) with a key: the nodes
    fetch their fragments over that HTTPS, trusting the certificate the coordinator sent them
    (self-signed here); /api/status needs the key; a client that trusts the certificate gets
    the single process's answer, one that does not trust it, or speaks plain HTTP, gets none."""
    from tests.support.mesh_harness import MeshProcesses

    cert, key = _self_signed(tmp_path)
    mesh = MeshProcesses(
        tmp_path,
        nodes=2,
        node_memory_gb=memory_cap_gb(None, 2, 1024),
        api_key=ARGV_KEY,
        tls_certificate=cert,
        serve_args=(
            "--context",
            "1024",
            "--api-key",
            ARGV_KEY,
            "--ssl-certfile",
            str(cert),
            "--ssl-keyfile",
            str(key),
        ),
    )
    mesh.start()
    try:
        status = mesh.wait_ready()
        assert len(status["stages"]) == 2 and all(
            n["bytes_downloaded"] > 0 for n in status["nodes"]
        )
        anonymous = httpx.get(f"{mesh.base_url}/api/status", verify=_trust(cert), timeout=10)
        assert anonymous.status_code == 401
        assert _ask(mesh.client()) == _ask_single()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{mesh.base_url}/health", timeout=10)  # the system's CAs do not know it
        with pytest.raises(httpx.HTTPError):
            httpx.get(mesh.base_url.replace("https", "http") + "/health", timeout=10)
    finally:
        mesh.stop()


def _ask_single() -> str:
    from seamline.app import LocalModel
    from seamline.params import SamplingParams

    model = LocalModel.load(context=1024)
    prompt = model.codec.encode_chat(QUESTION)
    params = SamplingParams(max_tokens=12, stop_token_ids=model.codec.stop_ids)
    return model.codec.decode(list(model.engine.generate(prompt, params)))
