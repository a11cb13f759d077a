"""Members that fail (`seamline bench fuzz`'s ``attacks``): a real ``Node`` of the mesh, changed as
a broken build or an attacker would change it, run and armed as ``attack_liar``'s lying members
are (``Liar``: ``{"joined": t}``, ``{"armed": t}``, and on ``quit`` ``{"result": ...}``).

- ``flapping_member``: once armed, it says its stage failed on every request it is sent. It is
  taken for lost, rejoins at once, and waits out a back-off that grows with each failure before
  it is planned again; the bench counts the mesh's re-plans over ``FLAP_WINDOW_S``.
- ``refused_frame``: once armed, every ``REFUSE_EVERY_S`` it sends one row out of step (its
  prefix hash changed) to the stage after it (the last stage: a token to stage 0), which
  refuses it. The request's attempt fails at once and it replays; the bench takes the seconds
  from each corrupted row to the coordinator's word that the request replays.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from seamline.mesh.node.process import Node
from seamline.net.link import LinkClosed
from seamline.net.messages import Failure
from seamline_bench.attack_liar import Liar
from seamline_bench.attack_member import emit

MODES = ("flapping_member", "refused_frame")
FLAP_WINDOW_S = 60.0  # the flapping member's attack lasts this long: re-plans are counted over it
REFUSE_EVERY_S = 2.0


class FailingMember(Liar):
    def __init__(self, target: dict[str, Any], mode: str) -> None:
        super().__init__(target, mode)
        self.corrupted: list[float] = []  # wall-clock times of the rows sent out of step

    def run(self) -> None:
        if self.mode == "refused_frame":
            _corrupts_outgoing(self.node, self.armed, self.corrupted)
        self._watch_opens()
        self.node.join()
        threading.Thread(target=self._serve, daemon=True).start()
        emit({"joined": time.monotonic(), "node_id": self.node.options.node_id})
        for line in sys.stdin:
            if line.strip() == "arm":
                self.armed.set()
                emit({"armed": time.monotonic()})
                if self.mode == "flapping_member":
                    threading.Thread(target=self._flap, daemon=True).start()
            elif line.strip() == "quit":
                break
        self.counts["rows_sent_out_of_step"] = len(self.corrupted)
        emit({"result": {"mode": self.mode, **self.counts, "corrupted_at": self.corrupted}})

    def _flap(self) -> None:
        """Say its stage failed on every request it is sent, as it opens; it goes on after it
        is lost and rejoins."""
        done: set[int] = set()
        while True:
            fresh = [r for r in list(self.seen) if r not in done]
            done.update(fresh)
            control = self.node.control
            for request in fresh:
                try:
                    if control is not None:
                        control.send_message(Failure(request=request, reason="this stage failed"))
                        self.counts["stage_failures_reported"] += 1
                except LinkClosed:
                    self.counts["reported on a closed link"] += 1
            time.sleep(0.05)


def _corrupts_outgoing(node: Node, armed: threading.Event, corrupted: list[float]) -> None:
    """Once a route is set, what its stage sends on (hidden rows downstream, or the last stage's
    tokens to stage 0) passes through here: a row every ``REFUSE_EVERY_S`` goes out of step."""
    route = node._route
    last = [0.0]

    def out_of_step(rows: Any) -> Any:
        if not armed.is_set() or not rows or time.monotonic() - last[0] < REFUSE_EVERY_S:
            return rows
        last[0] = time.monotonic()
        corrupted.append(time.time())
        first = dataclasses.replace(rows[0], hash_before=rows[0].hash_before ^ 1)
        return [first, *rows[1:]]

    def tampered(send: Callable[..., None]) -> Callable[..., None]:
        return lambda rows, *rest: send(out_of_step(rows), *rest)

    def tampered_route(message: Any) -> None:
        route(message)
        links = node.worker.links if node.worker is not None else None
        if links is not None and links.downstream is not None:
            links.downstream = tampered(links.downstream)
        if links is not None and links.stage0 is not None:
            links.stage0 = tampered(links.stage0)

    node._route = tampered_route  # type: ignore[method-assign]


def replay_delays(corrupted: list[float], replays: list[float]) -> list[float]:
    """For each corrupted row, the seconds until the coordinator next said a request replays
    because a stage refused its frame (``replays``: when it said so, wall clock)."""
    delays = []
    for sent in corrupted:
        after = [t for t in sorted(replays) if t >= sent]
        if after:
            delays.append(round(after[0] - sent, 3))
    return delays


def replays_logged(log: Path) -> list[float]:
    """When the coordinator's log says a request replays because a stage refused its frame."""
    stamp = re.compile(
        r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*lost its route.*refused its frame"
    )
    times = []
    for line in log.read_text(errors="replace").splitlines():
        if match := stamp.match(line):  # the log's clock is local time, as time.time() is
            taken = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            times.append(taken.timestamp())
    return times


def armed(
    driver: Any, mesh: Any, name: str, duration_s: float
) -> tuple[float, float, dict[str, Any]]:
    """Arm the member and watch the coordinator's status for the attack's time (the flapping
    member's ``FLAP_WINDOW_S`` at least): its re-plans, and the members backing off."""
    plan_before = int(mesh.status().get("plan_id", 0))
    started = float(driver.ask("arm")["armed"])
    lasts = max(duration_s, FLAP_WINDOW_S) if name == "flapping_member" else duration_s
    backing_off: dict[str, float] = {}
    plan_id = plan_before
    while time.monotonic() < started + lasts:
        status = mesh.status()
        plan_id = int(status.get("plan_id", plan_id))
        backing_off.update(status.get("backing_off", {}))
        time.sleep(0.5)
    facts: dict[str, Any] = {}
    if name == "flapping_member":
        facts.update(
            window_s=lasts,
            replans_in_window=plan_id - plan_before,
            backed_off=sorted(backing_off),
        )
    return started, time.monotonic(), facts


def after_quit(name: str, said: dict[str, Any], log: Path) -> dict[str, Any]:
    """What the bench reports of the attack, once the member said what it did (``log``: the
    coordinator's)."""
    if name != "refused_frame":
        return {}
    delays = replay_delays(list(said.pop("corrupted_at", [])), replays_logged(log))
    return {
        "rows_out_of_step": said.get("rows_sent_out_of_step", 0),
        "replays_seen": len(delays),
        "replayed_within_s": max(delays) if delays else None,
        "replayed_median_s": sorted(delays)[len(delays) // 2] if delays else None,
    }
