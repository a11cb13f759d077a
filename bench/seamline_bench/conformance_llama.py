"""llama-server as the reference for one GGUF file: its prompt ids and its greedy answers with
their top log-probabilities (of the raw logits, before sampling)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from seamline.net.link import free_port
from seamline_bench.conformance_compare import Answer, Top

EXACT_KV = ("-ctk", "f32", "-ctv", "f32")  # the f32 KV cache that --precision exact is held to


class LlamaReference:
    """One llama-server process on ``gguf``; ``exact``: with an f32 KV cache."""

    def __init__(self, binary: Path, gguf: Path, exact: bool, threads: int, log: Path) -> None:
        self.port = free_port()
        command = [
            str(binary),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "--parallel",
            "1",
            "-c",
            "2048",
            "--no-webui",
            *(EXACT_KV if exact else ()),
        ]
        self.log = log.open("a")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_healthy()

    def _wait_healthy(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited with {self.proc.returncode}: see {self.log.name}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"llama-server not healthy after {timeout_s:.0f} s")

    def prompt_ids(self, text: str) -> list[int]:
        """The ids its /completion makes of ``text``: BOS as the file says, specials parsed."""
        body = {"content": text, "add_special": True, "parse_special": True}
        return [int(t) for t in self._post("/tokenize", body)["tokens"]]

    def greedy(self, text: str, tokens: int, top: int = 5) -> Answer:
        body: dict[str, Any] = {
            "prompt": text,
            "n_predict": tokens,
            "temperature": 0,
            "n_probs": top,
            "cache_prompt": False,
            "return_tokens": True,
            "seed": 0,
        }
        reply = self._post("/completion", body)
        chosen = [int(t) for t in reply["tokens"]]
        return Answer(chosen, _aligned(chosen, reply.get("completion_probabilities", [])))

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = httpx.post(f"{self.url}{path}", json=body, timeout=600)
        reply.raise_for_status()
        return dict(reply.json())

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _aligned(chosen: list[int], positions: list[dict[str, Any]]) -> list[Top]:
    """Each chosen token's top log-probabilities, ``{}`` where llama-server gives none: it leaves
    out the entry of a token that ends inside a UTF-8 character, so its list is matched to the
    tokens by each entry's own id, not by index."""
    tops: list[Top] = []
    k = 0
    for token in chosen:
        if k < len(positions) and int(positions[k]["id"]) == token:
            tops.append({int(e["id"]): float(e["logprob"]) for e in positions[k]["top_logprobs"]})
            k += 1
        else:
            tops.append({})
    return tops
