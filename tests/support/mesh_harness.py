"""Start real `seamline serve` and `seamline join` processes on loopback for mesh tests."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from seamline.net.link import free_port

TOKEN_LINE = re.compile(r"invite token .*: (seamline-\S+)")


def seamline_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "seamline.cli", *args]


def join_once(token: str, cache: Path, node_id: str = "n1") -> subprocess.CompletedProcess[str]:
    """A `seamline join` run to its end (the invite in the environment), for joins that must fail."""
    env = {**os.environ, "SEAMLINE_INVITE": token, "SEAMLINE_CACHE": str(cache)}
    return subprocess.run(
        seamline_cmd("join", "--node-id", node_id, "--quiet"),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@dataclass
class MeshProcesses:
    root: Path
    nodes: int
    model: str | None = None
    node_memory_gb: float | None = None
    serve_args: tuple[str, ...] = ()
    api_key: str = "none"  # sent on every call (a mesh started with --api-key needs it)
    tls_certificate: Path | None = None  # the API is served over HTTPS with it (in serve_args)
    port: int = field(default_factory=free_port)
    control_port: int = field(default_factory=free_port)
    fragments_port: int = field(default_factory=free_port)
    serve: subprocess.Popen[str] | None = None
    node_procs: list[subprocess.Popen[str]] = field(default_factory=list)
    output: list[str] = field(default_factory=list)
    token: str = ""
    prefix: tuple[str, ...] = ()  # `serve` runs under this command (say, prlimit)

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls_certificate else 'http'}://127.0.0.1:{self.port}"

    def http(self) -> httpx.Client:
        """A client that sends the key and trusts the API's certificate."""
        verify = (
            ssl.create_default_context(cafile=self.tls_certificate)
            if self.tls_certificate
            else True
        )
        return httpx.Client(
            headers={"Authorization": f"Bearer {self.api_key}"}, verify=verify, timeout=120
        )

    def start(self, join: bool = True, local_node: bool = False) -> MeshProcesses:
        """``local_node``: `serve` runs its own node too (one of ``nodes``), as a user's does."""
        args = [
            "serve",
            *(() if local_node else ("--no-local-node",)),
            "--nodes-expected",
            str(self.nodes),
            "--port",
            str(self.port),
            "--control-port",
            str(self.control_port),
            "--fragments-port",
            str(self.fragments_port),
            *self.serve_args,
        ]
        if (
            "--precision" not in self.serve_args
        ):  # answers are compared with LocalModel.load()'s exact path
            args += ["--precision", "exact"]
        if self.model:
            args += ["--model", self.model]
        env = {**os.environ, "SEAMLINE_CACHE": str(self.root / "coordinator")}
        self.serve = subprocess.Popen(
            [*self.prefix, *seamline_cmd(*args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        threading.Thread(target=self._collect, daemon=True).start()
        self.token = self._wait_token(timeout=180)
        if join:
            for i in range(self.nodes):
                self.join(f"node{i}")
        return self

    def join(
        self,
        node_id: str,
        token: str | None = None,
        extra: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),
    ) -> subprocess.Popen[str]:
        """A `seamline join` process; ``prefix`` runs it under another command (say, pinned to a core)."""
        args = [
            "join",
            token or self.token,
            "--node-id",
            node_id,
            "--quiet",
            "--no-progress",
            *extra,
        ]
        if self.node_memory_gb is not None:
            args += ["--max-memory", str(self.node_memory_gb)]
        env = {**os.environ, "SEAMLINE_CACHE": str(self.root / node_id)}
        proc = subprocess.Popen(
            [*prefix, *seamline_cmd(*args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.node_procs.append(proc)
        return proc

    def _collect(self) -> None:
        assert self.serve is not None and self.serve.stdout is not None
        for line in self.serve.stdout:
            self.output.append(line)

    def _wait_token(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.output):
                if match := TOKEN_LINE.search(line):
                    return match.group(1)
            if self.serve is not None and self.serve.poll() is not None:
                raise RuntimeError("serve exited:\n" + "".join(self.output))
            time.sleep(0.1)
        raise TimeoutError("serve printed no invite token:\n" + "".join(self.output))

    def wait_ready(self, timeout: float = 240) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.http().get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return self.status()
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"mesh not ready: {self.status_or_output()}")

    def status(self) -> dict[str, Any]:
        return dict(self.http().get(f"{self.base_url}/api/status", timeout=10).json())

    def status_or_output(self) -> str:
        try:
            return str(self.status())
        except httpx.HTTPError:
            return "".join(self.output)

    def client(self, timeout: float = 120) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.api_key,
            max_retries=0,
            timeout=timeout,
            http_client=self.http(),
        )

    def kill_mid_stream(self, proc: subprocess.Popen[str], after_chunks: int = 5) -> str:
        """Stream a long answer, kill ``proc`` after a few chunks: the API error's text
        (AssertionError if the stream ended without one)."""
        messages = [{"role": "user", "content": "Tell me a very long story."}]
        stream = self.client(timeout=60).chat.completions.create(
            model="default", max_tokens=400, temperature=0, stream=True, messages=messages
        )  # type: ignore[arg-type]
        chunks = 0
        try:
            for _ in stream:
                chunks += 1
                if chunks == after_chunks:
                    proc.kill()
        except openai.APIError as error:
            return str(error)
        raise AssertionError(f"the stream ended after {chunks} chunks without an error")

    def stop(self) -> None:
        for proc in [*self.node_procs, self.serve]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in [*self.node_procs, self.serve]:
            if proc is not None:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()


def split_completion(
    root: Path, model: Path, prompt: str, max_tokens: int, context: int, stages: int = 2
) -> str:
    """Greedy /v1/completions text of ``model`` served by a mesh whose memory caps force
    ``stages`` stages (asserted), started under ``root`` and stopped after."""
    from seamline.server.demo import memory_cap_gb

    mesh = MeshProcesses(
        root,
        nodes=stages,
        model=str(model),
        node_memory_gb=memory_cap_gb(str(model), stages, context),
        serve_args=("--context", str(context)),
    )
    try:
        mesh.start()
        assert len(mesh.wait_ready()["stages"]) == stages
        body = {"model": "default", "prompt": prompt, "temperature": 0, "max_tokens": max_tokens}
        reply = httpx.post(f"{mesh.base_url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return str(reply.json()["choices"][0]["text"])
    finally:
        mesh.stop()


def at_once(ask: Callable[[int], str], count: int, timeout_s: float = 300) -> dict[int, str]:
    """``ask(i)`` for i < count, all at once on threads; the answers that came back, by i."""
    answers: dict[int, str] = {}

    def one(i: int) -> None:
        answers[i] = ask(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s)
    return answers
