"""What an attack cost the legitimate clients (`seamline bench fuzz`'s ``attacks``), from their
answers (``chaos.ClientAnswer``: every token's time) over a window: the attack and ``after_s`` after.

- ``mesh_down_s``: the longest stretch in the window with no token to any client;
- ``requests_lost``: requests in the window that ended in an error;
- ``wrong_answers``: requests in the window whose answer is not the calm one (a near tie,
  ``bench.near_tie``, is counted apart as ``near_tie_flips``, as chaos does).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from seamline_bench.chaos import ClientAnswer


@dataclass(frozen=True)
class AttackWindow:
    start: float
    end: float  # the attack's end plus the time watched after it

    def takes(self, answer: ClientAnswer) -> bool:
        """Whether ``answer`` was under way in the window (began before its end, ended after its start)."""
        return answer.began < self.end and answer.ended > self.start


def mesh_down_s(answers: list[ClientAnswer], window: AttackWindow) -> float:
    times = sorted(t for a in answers for t in a.token_times if window.start <= t <= window.end)
    edges = [window.start, *times, window.end]
    return max(b - a for a, b in pairwise(edges))


def reference(
    answers: list[ClientAnswer], since: float, until: float
) -> tuple[dict[int, str], list[int]]:
    """Each client's calm answer (its last between ``since`` and ``until``), and the clients
    whose calm answers differ among themselves."""
    calm = [a for a in answers if since <= a.began and a.ended <= until and not a.error]
    texts: dict[int, set[str]] = {}
    for answer in calm:
        texts.setdefault(answer.client, set()).add(answer.text)
    return {a.client: a.text for a in calm}, sorted(c for c, t in texts.items() if len(t) > 1)


def window_metrics(
    answers: list[ClientAnswer], window: AttackWindow, calm: dict[int, str]
) -> tuple[dict[str, Any], list[ClientAnswer]]:
    """The window's figures, and the answers that differ from the calm ones (near ties not yet told apart)."""
    taken = [a for a in answers if window.takes(a)]
    lost = [a for a in taken if a.error]
    differ = [a for a in taken if not a.error and a.client in calm and a.text != calm[a.client]]
    return {
        "mesh_down_s": round(mesh_down_s(answers, window), 2),
        "requests": len(taken),
        "requests_lost": len(lost),
        "lost_errors": sorted({a.error[:160] for a in lost})[:3],
    }, differ
