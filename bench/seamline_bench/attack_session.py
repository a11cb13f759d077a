"""A live mesh under legitimate load, attacked in turn (`seamline bench fuzz`'s ``attacks``).

Eight clients stream chaos's eight requests (greedy and seeded) again and again. A calm phase,
until every client has one whole answer, gives each its calm answer. Each attack then runs;
the bench watches ``after_s`` more, and its window's figures are taken once the load has
stopped (an answer is recorded when it ends).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import openai
import psutil

from seamline_bench.attack_mesh import LiveMesh
from seamline_bench.attack_metrics import AttackWindow, reference, window_metrics
from seamline_bench.chaos import ClientAnswer, Clients

CLIENTS, TOKENS = 8, 48
CLIENT_TIMEOUT_S = 90.0  # a request that hangs longer is lost
CALM_MIN_S, CALM_MAX_S = 10.0, 180.0


class Watcher:
    """Polls /api/status every half second from the attack's start: when ``found`` first held
    (``detected_at``) and whether ``seen`` ever did (the liar planned, say)."""

    def __init__(
        self,
        mesh: LiveMesh,
        found: Callable[[dict[str, Any]], bool],
        seen: Callable[[dict[str, Any]], bool] = lambda s: False,
    ) -> None:
        self.mesh, self.found, self.seen = mesh, found, seen
        self.detected_at: float | None = None
        self.was_seen = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(20)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            status = self.mesh.status()
            if not status:
                continue
            self.was_seen = self.was_seen or self.seen(status)
            if self.detected_at is None and self.found(status):
                self.detected_at = time.monotonic()


@dataclass
class Attacked:
    """One attack's record: its window, what the attacker and the bench saw, processes that exited."""

    window: AttackWindow
    facts: dict[str, Any]
    exited: list[str]
    detected_s: float | None = None
    lying: bool = False


@dataclass
class Session:
    mesh: LiveMesh
    after_s: float
    load: Clients = field(init=False)
    calm: tuple[float, float] = (0.0, 0.0)
    attacked: dict[str, Attacked] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.load = Clients(self.mesh.server.url, CLIENTS, TOKENS)
        self.load.api = openai.OpenAI(
            base_url=self.mesh.server.url, api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S
        )

    def start(self) -> None:
        """Start the load; the calm phase lasts until every client has a whole answer."""
        self.load.start()
        time.sleep(3.0)  # warm-up, not counted
        since = time.monotonic()
        while time.monotonic() - since < CALM_MAX_S:
            done = {a.client for a in self.load.taken(since) if not a.error}
            if len(done) == CLIENTS and time.monotonic() - since >= CALM_MIN_S:
                break
            time.sleep(0.5)
        self.calm = (since, time.monotonic())

    def attack(
        self,
        name: str,
        run: Callable[[], tuple[float, float, dict[str, Any]]],
        watcher: Watcher | None = None,
        lying: bool = False,
    ) -> None:
        """Run one attack (``run`` gives its start, its end and what it saw), then watch ``after_s``."""
        honest = self.mesh.honest()
        gone_before = {n for n, p in honest.items() if p.poll() is not None}
        rss = _rss(honest["coordinator"].pid)
        if watcher is not None:
            watcher.start()
        start, end, facts = run()
        time.sleep(max(0.0, end + self.after_s - time.monotonic()))
        if watcher is not None:
            watcher.stop()
        exited = sorted(
            n for n, p in honest.items() if p.poll() is not None and n not in gone_before
        )
        facts["coordinator_rss_growth_mb"] = round(_rss(honest["coordinator"].pid) - rss, 1)
        detected = watcher.detected_at if watcher is not None else None
        self.attacked[name] = Attacked(
            AttackWindow(start, end + self.after_s),
            facts,
            exited,
            None if detected is None else round(detected - start, 2),
            lying,
        )

    def finish(self) -> tuple[dict[str, dict[str, Any]], list[tuple[str, ClientAnswer, str]]]:
        """Stop the load; each attack's figures, and the answers that differ from their calm one
        (attack, answer, calm text) for the near-tie judge."""
        self.load.stop()
        calm, unstable = reference(self.load.answers, *self.calm)
        out, differ = {}, []
        for name, record in self.attacked.items():
            figures, changed = window_metrics(self.load.answers, record.window, calm)
            out[name] = {
                **figures,
                "wrong_answers": len(changed),
                "processes_exited": len(record.exited),
                "exited": record.exited,
                **({"detected_s": record.detected_s} if record.lying else {}),
                "attack": record.facts,
                "calm_answers_unstable": unstable,
                "attack_s": round(record.window.end - record.window.start - self.after_s, 1),
            }
            differ += [(name, a, calm[a.client]) for a in changed]
        return out, differ


def _rss(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return float("nan")
