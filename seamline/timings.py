"""`seamline run --verbose`: how long an answer took, as `llama-cli` and `ollama run --verbose` say it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Timings:
    """Token arrival times of one answer, from just before the prompt went in."""

    prompt_tokens: int
    start: float = field(default_factory=time.perf_counter)
    arrivals: list[float] = field(default_factory=list)

    def token(self) -> None:
        self.arrivals.append(time.perf_counter())

    def report(self, precision: str) -> str:
        if not self.arrivals:
            return f"no token generated; precision {precision}"
        first = self.arrivals[0] - self.start
        lines = [
            f"prompt eval: {self.prompt_tokens} tokens in {first * 1e3:.1f} ms "
            f"({self.prompt_tokens / first:.1f} tokens/s)",
            f"time to first token: {first * 1e3:.1f} ms",
        ]
        decoded, span = len(self.arrivals) - 1, self.arrivals[-1] - self.arrivals[0]
        if decoded and span > 0:
            lines.append(
                f"decode: {decoded} tokens in {span * 1e3:.1f} ms ({decoded / span:.1f} tokens/s, "
                f"{span / decoded * 1e3:.2f} ms/token)"
            )
        lines.append(f"precision: {precision}")
        return "\n".join(lines)
