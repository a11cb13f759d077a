"""A served OpenAI API in this process, and its client."""

from __future__ import annotations

import os
import random
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn

from seamline.net.link import free_port
from seamline.runtime.backend import Backend
from seamline.server.api_options import ApiLimits
from seamline.server.openai_api import create_app
from tests.support.mesh_harness import seamline_cmd

NAME = "SmolLM2-135M-Instruct.Q4_1"


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def bind_free_port() -> socket.socket:
    """A listening-ready socket on a free port in 20000-30000 (below the ephemeral range)."""
    for port in random.sample(range(20000, 30000), 50):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", port))
            return sock
        except OSError:
            sock.close()
    raise RuntimeError("no free port in 20000-30000")


def serve(backend: Backend, limits: ApiLimits = ApiLimits()) -> AbstractContextManager[str]:
    """Run the API for ``backend`` on a real uvicorn server in a thread; yield its base URL."""
    return serve_app(create_app(backend, limits=limits))


@contextmanager
def serve_app(app: Any, log_level: str = "warning") -> Iterator[str]:
    """Run ``app`` on a real uvicorn server on 127.0.0.1 in a thread; yield its base URL."""
    sock = bind_free_port()
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, messages: Any = QUESTION, **fields: Any) -> Any:
    """``client.chat.completions.create`` with the served model and the capital question by default."""
    return client.chat.completions.create(**{"model": NAME, "messages": messages, **fields})


def start_server(
    tmp: Path,
    *args: str,
    env_key: str | None = None,
    scheme: str = "http",
    verify: ssl.SSLContext | bool = True,
) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    env = {**os.environ, "SEAMLINE_CACHE": str(tmp / "cache")}
    env.pop("SEAMLINE_API_KEY", None)
    if env_key:
        env["SEAMLINE_API_KEY"] = env_key
    proc = subprocess.Popen(
        seamline_cmd("serve", "--single", "--port", str(port), "--precision", "exact", *args),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"{scheme}://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            if httpx.get(f"{url}/health", timeout=2, verify=verify).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
