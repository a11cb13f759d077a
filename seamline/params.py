"""What a request asks of generation: how to draw tokens and when to stop. It crosses the
wire as it is (``net.messages.Open``), so it sits below both the runtime and the wire."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ConfigDict

from seamline.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How a sequence draws and when it stops; it crosses the wire as it is (``Open``)."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # validated where it arrives from a peer

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
