"""Stages of one model wired in one process as a mesh wires them over sockets, each link a
thread that delivers in order after a delay (a link's latency): stage 0 then keeps rows in
flight while the later stages work, as it does over real links."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from seamline.model.stage import Stage
from seamline.net.frames import HiddenFrame, Row, RowFlag, TokenFrame, TokenRow
from seamline.net.messages import Close, Message, Open, Prompt
from seamline.params import SamplingParams
from seamline.runtime.speculation import Speculation
from seamline.runtime.stage_worker import StageWorker


class DelayedLink:
    """Calls delivered in the order sent, each ``delay_s`` after it was sent."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls: queue.Queue[tuple[float, Callable[[], None]] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._deliver, daemon=True)
        self.thread.start()

    def put(self, call: Callable[[], None]) -> None:
        self.calls.put((time.monotonic() + self.delay_s, call))

    def _deliver(self) -> None:
        while (item := self.calls.get()) is not None:
            due, call = item
            time.sleep(max(0.0, due - time.monotonic()))
            call()

    def close(self) -> None:
        self.calls.put(None)
        self.thread.join(timeout=30)


class Pipeline:
    """``stages`` in order (the first owns the embedding, the last the head); ``speculation``:
    stage 0's. ``caches`` keeps each request's caches as each stage lets go of them."""

    def __init__(
        self, stages: list[Stage], speculation: Speculation | None, delay_s: float = 0.005
    ) -> None:
        last = len(stages) - 1
        self.workers = [
            StageWorker(stage, is_first=i == 0, is_last=i == last, context_length=512)
            for i, stage in enumerate(stages)
        ]
        self.links = [
            DelayedLink(delay_s) for _ in range(len(stages))
        ]  # downstream of each stage; the last: back
        head = self.workers[0].head
        assert head is not None
        self.workers[0].micro_batches = len(stages)
        head.speculate(speculation)
        self.results: dict[int, list[int]] = {}
        self.rows: list[Row] = []  # every row the last stage ran
        self.finished = threading.Semaphore(0)
        for worker, link, after in zip(self.workers, self.links, self.workers[1:]):
            worker.links.downstream = self._hidden_to(link, after)
            worker.links.downstream_message = lambda msg, link=link, after=after: link.put(
                lambda: _message(after, msg)
            )
        tail = self.workers[-1]
        tail.links.stage0 = lambda rows: self.links[-1].put(
            lambda: self.workers[0].tokens(TokenFrame(tuple(rows)))
        )
        tail.links.results = self._collect

    def _hidden_to(self, link: DelayedLink, after: StageWorker) -> Callable[..., None]:
        def send(
            rows: list[Row], hidden: torch.Tensor, ids: torch.Tensor, signed: object = None
        ) -> None:
            frame = HiddenFrame(tuple(rows), hidden.clone(), None if ids is None else ids.clone())
            if after is self.workers[-1]:
                self.rows += rows
            link.put(lambda: after.hidden(frame))

        return send

    def _collect(self, rows: list[TokenRow]) -> None:
        collect(rows, self.results, self.finished)

    def generate(self, request: int, prompt: list[int], params: SamplingParams) -> list[int]:
        """One request's tokens; its caches stay on every stage until ``close``."""
        self.workers[0].open(
            Open(request=request, sampling=params, prompt_len=len(prompt), context_length=512)
        )
        self.workers[0].prompt(Prompt(request=request, tokens=tuple(prompt)))
        assert self.finished.acquire(timeout=120)
        return self.results[request]

    def close(self) -> None:
        for link in self.links:
            link.close()


def collect(
    rows: list[TokenRow], results: dict[int, list[int]], finished: threading.Semaphore
) -> None:
    """The coordinator's side of the last stage's tokens: each request's output, and a release
    of ``finished`` per request that ended."""
    for row in rows:
        if not row.flags & RowFlag.STOPPED:
            results.setdefault(row.request, []).append(row.token)
        if row.flags & RowFlag.DONE:
            finished.release()


def _message(worker: StageWorker, msg: Message) -> None:
    if isinstance(msg, Open):
        worker.open(msg)
    elif isinstance(msg, Close):
        worker.close(msg)
    else:
        worker.lifetime(msg)  # type: ignore[arg-type]
