"""Checking what a joining node claims about itself: its speed, by a product the coordinator
times and checks, and (after it loads) its memory, by the resident bytes its share must take.

Speed: the coordinator sends a seed; the node makes the seeded matrix (not timed) and says so;
then the coordinator sends a fresh random vector and times the answer, the sums of the
matrix-vector product's row blocks, which it checks against its own product (so the node
cannot answer without computing, nor compute ahead). A node measured below a third of the rate
it claimed is planned at the measured rate. Memory cannot be proved from afar; a stage whose
resident bytes after loading fall short of half its weights is refused, and a claim is never
worth more than the share it earns (a node claiming 1 TB must still load and hold it).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

import torch

from seamline.net.link import Link, LinkClosed
from seamline.net.messages import SpeedProbe, SpeedReady, SpeedSums

log = logging.getLogger("seamline.coordinator")
ROWS, COLS, BLOCKS = 8192, 1024, 64  # a 32 MiB float32 matrix: about what a node measured itself on
SLACK = 3.0  # a node is believed unless it is this much slower than it claimed
ANSWER_TIMEOUT_S = 30.0


def probe_matrix(seed: int, rows: int = ROWS, cols: int = COLS) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def block_sums(matrix: torch.Tensor, vector: torch.Tensor, blocks: int = BLOCKS) -> list[float]:
    """The sums of ``matrix @ vector`` over ``blocks`` equal row blocks: the probe's answer."""
    return torch.mv(matrix, vector).view(blocks, -1).sum(dim=1).tolist()


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
        """The rate to plan this node at: its claim, or what it measured when far below the claim;
        None when it gave no right answer (it is not believed at all)."""
        seed = secrets.randbits(31)
        try:
            self.link.send_message(SpeedProbe(seed=seed, rows=ROWS, cols=COLS))
            matrix = probe_matrix(seed)
            if self._wait("speed_ready") is None:
                return None
            vector = torch.randn(COLS)
            began = time.perf_counter()
            self.link.send_message(SpeedProbe(seed=seed, rows=ROWS, cols=COLS, vector=vector.tolist()))
            sums = self._wait("speed_sums")
            took = time.perf_counter() - began
        except LinkClosed:
            return None
        if not isinstance(sums, SpeedSums) or not torch.allclose(torch.tensor(sums.sums), torch.tensor(block_sums(matrix, vector)),
                                                                 rtol=1e-3, atol=1e-2):  # fmt: skip
            log.warning("node at %s answered the speed probe wrongly: not believed", self.link.name)
            return None
        measured = matrix.nbytes / max(took - self.rtt_s, 1e-6)
        if measured * SLACK < self.claimed:
            log.warning("%s claimed %.1f GB/s but computed at %.1f GB/s: planned at the measured rate",
                        self.link.name, self.claimed / 1e9, measured / 1e9)  # fmt: skip
            return measured
        return self.claimed

    def _wait(self, kind: str) -> object | None:
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        with self._arrived:
            while kind not in self._answers:
                if not self._arrived.wait(timeout=max(0.0, deadline - time.monotonic())):
                    return None
            return self._answers.pop(kind)
