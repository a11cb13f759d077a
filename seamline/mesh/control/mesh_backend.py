"""MeshBackend: the API's Backend over a stage pipeline run by the coordinator.

Each request is mirrored to every stage (open/close) and its prompt goes to stage 0; the
last stage's tokens arrive on its control link and are routed to the waiting request. The
backend keeps each request's history (prompt, tokens so far, sampling with its seed fixed),
so a request whose route is lost is replayed on the next one (``generate``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
import time
from collections.abc import AsyncIterator

from seamline.errors import OverloadedError, RequestError, SeamlineError
from seamline.mesh.control.coordinator import Coordinator, StartupError
from seamline.mesh.control.mesh_metrics import MeshReporter
from seamline.mesh.control.mesh_state import RequestReplayed, RequestResumed
from seamline.net.frames import TokenRow
from seamline.net.link import LinkClosed
from seamline.net.messages import Open
from seamline.params import SamplingParams
from seamline.runtime.backend import Readiness
from seamline.runtime.sampling import TokenEvent, request_seed
from seamline.runtime.stage_rows import token_event
from seamline.text import TextCodec


class RequestFailed(SeamlineError):
    """A stage failed or left while the request was in flight."""


class RouteLost(RequestFailed):
    """A node of the request's route left the mesh (or the mesh re-planned, ``node_lost``
    False): the request is replayed on the next route."""

    def __init__(self, message: str, node_lost: bool = True) -> None:
        super().__init__(message)
        self.node_lost = node_lost


class NotServing(RouteLost):
    """The route went between the readiness check and the open (a node is gone, the re-plan not
    applied yet): nothing was lost, and no replay is counted; the request waits and opens again."""


class Implicated(RouteLost):
    """The route was lost while this request was starting on it, as a request that makes a
    node fail would see it."""


MAX_REQUESTS = 320  # in flight at once (the single-process server: 64 running + 256 waiting)
REPLAY_DEADLINE_S = (
    120.0  # a request whose route was lost waits this long for the mesh to serve again
)
READY_POLL_S = 0.05
MAX_REPLAYS = 8  # routes a request may lose before it fails
SUSPECT_WINDOW_S = (
    2.0  # a node lost this soon after a request opened on it, before its first token...
)
MAX_IMPLICATED = 2  # ...this many times: the request is ended, not replayed again


class MeshBackend:
    def __init__(
        self,
        coordinator: Coordinator,
        codec: TextCodec,
        model_name: str,
        context_length: int,
        max_requests: int = MAX_REQUESTS,
        replay_deadline_s: float = REPLAY_DEADLINE_S,
    ) -> None:
        self.coordinator = coordinator
        self.max_requests = max_requests
        self.replay_deadline_s = replay_deadline_s
        self.codec = codec
        self.model_name = model_name
        self.context_length = context_length
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[object]]] = {}
        self._lock = threading.Lock()
        coordinator.on_tokens = self._deliver
        coordinator.on_failure = self._fail
        coordinator.in_flight = (
            self._waiting.__contains__
        )  # whose tokens and failures a member may report
        self.report = MeshReporter(coordinator)  # its nodes, links and events, for /metrics

    def readiness(self) -> Readiness:
        """Ready while a route serves. Once the mesh has served, a new request is taken while it
        heals too (it waits for the route, as a replayed one does, up to the replay deadline)."""
        ready = self.coordinator.ready.is_set()
        return Readiness(
            ready, "" if ready else self.coordinator.state, waits=self.coordinator.plan_id > 0
        )

    async def generate(
        self, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        """The request's tokens. When a node is lost mid-answer the mesh re-plans, and the request
        is replayed on the new route: prompt and tokens so far prefilled, then decoding from the
        next position. Sampling draws from (seed, position), so the tokens go on as they would have.
        The prompt and parameters are the API's, validated there (and by stage 0 as it reads them)."""
        spec = dataclasses.replace(
            params, seed=request_seed(params.seed), stop_strings=()
        )  # stop strings stay here
        generated: list[int] = []
        lost: _Loss | None = None
        replays = implicated = 0
        while True:
            if not self.coordinator.ready.is_set():  # healing: wait for the route, as a replay does
                lost = lost or _Loss(time.monotonic())
                await self._until_ready(
                    lost, RouteLost(f"the mesh is not serving: {self.coordinator.state}")
                )
            try:
                async for event in self._attempt(prompt, spec, generated, replaying=replays > 0):
                    if lost is not None and replays:
                        self._resumed(lost, len(generated))
                    lost = None
                    if event.shown:
                        generated.append(event.token)
                    yield event
                return
            except NotServing as exc:  # a tight loop of replays here burned all 8 in 0.1 s
                lost = lost or _Loss(time.monotonic())
                await asyncio.sleep(READY_POLL_S)
                await self._until_ready(lost, exc)
            except RouteLost as exc:
                replays += 1
                implicated += isinstance(exc, Implicated)
                _give_up_after(exc, replays, implicated)
                lost = lost or _Loss(time.monotonic())
                self.coordinator.keeper.post(RequestReplayed(len(generated), str(exc)))
                await self._until_ready(lost, exc)

    async def _attempt(
        self, prompt: list[int], spec: SamplingParams, generated: list[int], replaying: bool
    ) -> AsyncIterator[TokenEvent]:
        """One run of the request on the current route: stage 0 takes ``prompt`` and the tokens
        ``generated`` so far, and resumes after them as it resumes a preempted sequence."""
        queue: asyncio.Queue[object] = asyncio.Queue()
        with self._lock:
            if len(self._waiting) >= self.max_requests and not replaying:
                raise OverloadedError(
                    f"{len(self._waiting)} requests are already in flight; try again later"
                )
            request = _new_id(self._waiting)
            self._waiting[request] = (asyncio.get_running_loop(), queue)
        try:
            try:
                self.coordinator.open_request(
                    Open(
                        request=request,
                        sampling=spec,
                        prompt_len=len(prompt),
                        context_length=self.context_length,
                    ),
                    prompt + generated,
                )
            except (
                StartupError,
                LinkClosed,
            ) as exc:  # the route went between the check and the open
                raise NotServing(f"the mesh is not ready: {exc}") from None
            opened, drew = time.monotonic(), False
            while True:
                item = await queue.get()
                if (
                    isinstance(item, RouteLost)
                    and item.node_lost
                    and not drew
                    and time.monotonic() - opened < SUSPECT_WINDOW_S
                ):
                    raise Implicated(str(item))
                if isinstance(item, Exception):
                    raise item
                drew = True
                assert isinstance(item, TokenRow)
                event = token_event(item)
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            with self._lock:
                self._waiting.pop(request, None)
            self.coordinator.close_request(request)

    async def _until_ready(self, lost: _Loss, cause: Exception) -> None:
        """Wait for the mesh to serve again; RequestFailed once ``replay_deadline_s`` has passed
        since the route was lost."""
        while True:  # the deadline holds where the mesh reads ready and opens still fail
            if time.monotonic() - lost.at > self.replay_deadline_s:
                raise RequestFailed(
                    f"{cause}; the mesh could not serve again within {self.replay_deadline_s:.0f} s "
                    f"({self.coordinator.state})"
                ) from None
            if self.coordinator.ready.is_set():
                break
            await asyncio.sleep(READY_POLL_S)
        lost.served_again = lost.served_again or time.monotonic()

    def _resumed(self, lost: _Loss, tokens: int) -> None:
        """A replay drew its first token: how long the route took to serve again, and the
        replay to draw after it."""
        now = time.monotonic()
        served = lost.served_again or now
        self.coordinator.keeper.post(RequestResumed(tokens, served - lost.at, now - served))

    def _deliver(self, rows: list[TokenRow]) -> None:
        for row in rows:
            self._put(row.request, row)

    def _fail(self, request: int | None, reason: str, blame: str) -> None:
        with self._lock:
            targets = list(self._waiting) if request is None else [request]
        for target in targets:
            self._put(target, _failure(reason, blame))

    def _put(self, request: int, item: object) -> None:
        with self._lock:
            waiting = self._waiting.get(request)
        if waiting is not None:
            loop, queue = waiting
            loop.call_soon_threadsafe(queue.put_nowait, item)


@dataclasses.dataclass
class _Loss:
    """When a request lost its route, and when the mesh served again after (0: not yet)."""

    at: float
    served_again: float = 0.0


def _give_up_after(exc: RouteLost, replays: int, implicated: int) -> None:
    """RequestFailed when the request is not replayed again: its route was lost as it started
    ``implicated`` times, or lost ``replays`` times in all."""
    if implicated >= MAX_IMPLICATED:
        raise RequestFailed(
            f"{exc}; the nodes this request ran on failed as it started, "
            f"{implicated} times: ended rather than replayed again"
        ) from None
    if replays > MAX_REPLAYS:
        raise RequestFailed(
            f"{exc}; the request lost its route {MAX_REPLAYS} times, given up"
        ) from None


def _failure(reason: str, blame: str) -> Exception:
    """What a failure report means for a request: its own fault, the load's, a route lost
    (replayed: ``replanned`` when no node was lost), or a stage's failure."""
    if blame == "lost" or blame == "replanned":
        return RouteLost(reason, node_lost=blame == "lost")
    return {"request": RequestError, "load": OverloadedError}.get(blame, RequestFailed)(reason)


def _new_id(taken: dict[int, object]) -> int:
    """A request id no one can guess (a peer that could would forge its frames), none in use."""
    while (request := secrets.randbits(63)) in taken:
        pass
    return request
