"""Checking what a joining node claims about itself: its speed, by a product the coordinator
times and checks, and (after it loads) its memory, by the probe its whole stage must answer.

Speed: the coordinator sends a seed; the node makes the seeded matrix (not timed) and says so;
then the coordinator sends a fresh random vector and times the answer, the sums of the
matrix-vector product's row blocks, which it checks against its own product (so the node
cannot answer without computing, nor compute ahead); the fastest of a few counts. That is the
rate the node proved: it is planned at no more than 1.2 times it, whatever it claimed
(``plan.measured.planned_rate``). Memory cannot be proved from afar: a node is given layers by
the room it claims, and before a route is published each stage must compute a probe over its
whole range as the coordinator does (``control.stage_checks``), so a node claiming 1 TB must
still load and hold what it was given, or it is removed.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

import torch

from seamline.mesh.plan.measured import PROVEN_ALLOWANCE
from seamline.net.link import Link, LinkClosed
from seamline.net.messages import SpeedProbe, SpeedReady, SpeedSums

log = logging.getLogger("seamline.coordinator")
ROWS, COLS, BLOCKS = 8192, 1024, 64  # a 32 MiB float32 matrix: about what a node measured itself on
ROUNDS = 6  # products timed, a little apart; the fastest counts
PAUSE_S = 0.02
ATTEMPTS = 3  # a proof short of the claim is tried again, a little later (a busy moment passes)
RETRY_PAUSE_S = 0.25
_ONE_AT_A_TIME = (
    threading.Lock()
)  # nodes joining together are probed in turn: no probe slows another
ANSWER_TIMEOUT_S = 30.0


def probe_block(
    seed: int, block: int, rows: int = ROWS, cols: int = COLS, blocks: int = BLOCKS
) -> torch.Tensor:
    """One row block of the probe matrix, seeded on its own: the coordinator checks an answer a
    block at a time and never holds the whole matrix (a join must not cost it 32 MiB)."""
    generator = torch.Generator().manual_seed(seed * blocks + block)
    return torch.randn(rows // blocks, cols, generator=generator)


def probe_matrix(
    seed: int, rows: int = ROWS, cols: int = COLS, blocks: int = BLOCKS
) -> torch.Tensor:
    return torch.cat([probe_block(seed, b, rows, cols, blocks) for b in range(blocks)])


def expected_sums(seed: int, vectors: torch.Tensor) -> torch.Tensor:
    """``block_sums`` of the seeded matrix for each column of ``vectors`` ([COLS, n] -> [n, BLOCKS])."""
    return torch.stack([(probe_block(seed, b) @ vectors).sum(dim=0) for b in range(BLOCKS)], dim=1)


def block_sums(
    matrix: torch.Tensor, vector: torch.Tensor, blocks: int = BLOCKS, one_thread: bool = True
) -> list[float]:
    """The sums of ``matrix @ vector`` over ``blocks`` equal row blocks: the probe's answer. A
    node answers some rounds on one thread and some on all (the fastest counts): threads that
    share cores with a busy neighbour wait for each other and run many times slower than one
    thread, while a machine with many cores to itself streams faster on all of them."""
    threads = torch.get_num_threads()
    if one_thread:
        torch.set_num_threads(1)
    try:
        return torch.mv(matrix, vector).view(blocks, -1).sum(dim=1).tolist()
    finally:
        torch.set_num_threads(threads)


def rate_of(took_s: float, rtt_s: float) -> float:
    """The rate a product answered in ``took_s`` proves: the float32 matrix streamed once, in the
    time less the link's round trip, of which no more than half the time is taken off (the node
    answers the pings that measure its link: a round trip it made long must not make a slow
    answer fast)."""
    return ROWS * COLS * 4 / max(took_s - min(rtt_s, took_s / 2), 1e-6)


class SpeedCheck:
    """The coordinator's side of one node's probe; ``messages`` feeds it the node's answers."""

    def __init__(self, link: Link, claimed_bytes_per_s: float, rtt_s: float) -> None:
        self.link, self.claimed, self.rtt_s = link, claimed_bytes_per_s, rtt_s
        self._answers: dict[str, object] = {}
        self._arrived = threading.Condition()

    def answer(self, message: SpeedReady | SpeedSums) -> None:
        with self._arrived:
            self._answers[message.kind] = message
            self._arrived.notify_all()

    def run(self) -> float | None:
        """The rate this node proved (bytes/s of its fastest right answer); None when it gave no
        right answer (it is not believed at all)."""
        with _ONE_AT_A_TIME:
            return self._run()

    def _run(self) -> float | None:
        seed = secrets.randbits(31)
        try:
            self.link.send_message(SpeedProbe(seed=seed, rows=ROWS, cols=COLS))
            vectors = torch.randn(
                COLS, ROUNDS * ATTEMPTS
            )  # fresh for this probe, sent one at a time
            expected = expected_sums(seed, vectors)
            if self._wait("speed_ready") is None:
                return None
            proven = 0.0
            for attempt in range(ATTEMPTS):
                if attempt:
                    time.sleep(RETRY_PAUSE_S)
                rounds = range(attempt * ROUNDS, (attempt + 1) * ROUNDS)
                took = min(self._round(seed, vectors[:, i], expected[i]) for i in rounds)
                proven = max(proven, rate_of(took, self.rtt_s))
                if proven * PROVEN_ALLOWANCE >= self.claimed:
                    break
        except LinkClosed:
            return None
        except ValueError as exc:
            log.warning("%s: %s: not believed", self.link.name, exc)
            return None
        if proven * PROVEN_ALLOWANCE < self.claimed:
            log.warning(
                "%s claimed %.1f GB/s but proved %.1f GB/s: planned at %.1f GB/s at most",
                self.link.name,
                self.claimed / 1e9,
                proven / 1e9,
                proven * PROVEN_ALLOWANCE / 1e9,
            )
        return proven

    def _round(self, seed: int, vector: torch.Tensor, expected: torch.Tensor) -> float:
        """One timed product on a fresh vector; ValueError if the answer is wrong or missing."""
        time.sleep(PAUSE_S)
        began = time.perf_counter()
        self.link.send_message(SpeedProbe(seed=seed, rows=ROWS, cols=COLS, vector=vector.tolist()))
        sums = self._wait("speed_sums")
        took = time.perf_counter() - began
        if not isinstance(sums, SpeedSums) or not torch.allclose(
            torch.tensor(sums.sums), expected, rtol=1e-3, atol=1e-2
        ):
            raise ValueError("it answered the speed probe wrongly")
        return took

    def _wait(self, kind: str) -> object | None:
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        with self._arrived:
            while kind not in self._answers:
                if not self._arrived.wait(timeout=max(0.0, deadline - time.monotonic())):
                    return None
            return self._answers.pop(kind)
