"""What the coordinator knows of one member: its join, its control link, what it reported."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from seamline.mesh.plan.cores import Placement
from seamline.mesh.plan.measured import planned_rate
from seamline.mesh.plan.types import DeviceInfo, LinkCost, NodeInfo
from seamline.mesh.protocol.claims import SpeedCheck
from seamline.mesh.protocol.link_probe import Pongs
from seamline.net.link import Link
from seamline.net.messages import Join, Loading, ProbeResult, Ready, Stats


class Beats:
    """The heartbeat pings a member has not answered yet (nonce -> when sent)."""

    def __init__(self) -> None:
        self._sent: dict[int, float] = {}
        self._lock = threading.Lock()

    def sent(self, nonce: int, when: float) -> None:
        with self._lock:
            self._sent[nonce] = when

    def cancel(self, nonce: int) -> None:
        """A ping that could not be sent."""
        with self._lock:
            self._sent.pop(nonce, None)

    def answered(self, nonce: int) -> bool:
        """A pong for one of them: it and every ping sent before it are answered; False when
        no such ping is waiting."""
        with self._lock:
            when = self._sent.get(nonce)
            if when is None:
                return False
            self._sent = {n: t for n, t in self._sent.items() if t > when}
            return True

    def unanswered_for(self, now: float) -> float:
        """Seconds since the oldest unanswered ping was sent (0 when none waits)."""
        with self._lock:
            return now - min(self._sent.values()) if self._sent else 0.0


@dataclass
class NodeHandle:
    join: Join
    link: Link
    ready: Ready | None = None
    loading: Loading | None = None  # its fragments' download under way (None once it is ready)
    linked: bool = False
    stats: Stats | None = None
    failure: str | None = None  # a failure the node reported outside any request
    changed: threading.Condition = field(
        default_factory=threading.Condition
    )  # notified on each update
    inbound: bool = True  # takes connections (else its data links come through the relay)
    measured: LinkCost | None = None  # its link to the coordinator
    pongs: Pongs = field(default_factory=Pongs)
    speed_check: SpeedCheck | None = None
    proven_rate: float | None = None  # the rate it proved on the coordinator's timed product
    served_rate: float | None = None  # the rate its stage served at, when clearly below its plan
    address: str = ""  # the address its control link comes from (``plan.cores``)
    checked: bool = False  # its link measured and its speed checked: it may be planned
    last_heard: float = field(
        default_factory=time.monotonic
    )  # when it last sent anything (heartbeats)
    beats: Beats = field(
        default_factory=lambda: Beats()
    )  # heartbeat pings sent it and not yet answered
    probe_result: ProbeResult | None = None  # its answer to the start-up check's probe
    memory_cap: int | None = (
        None  # the room it said it has when it could not load a stage: planned with no more
    )

    @property
    def node_id(self) -> str:
        return self.join.node_id

    def update(self, **fields: object) -> None:
        """Set ``fields`` and wake whoever waits for a change of this member."""
        with self.changed:
            for name, value in fields.items():
                setattr(self, name, value)
            self.changed.notify_all()

    def info(self, core_share: float = 1.0) -> NodeInfo:
        """What the planner knows of it; ``core_share``: the share of its CPUs' time it has
        (``plan.cores``), which scales its planned rate (its CPU's; its GPUs' are their own)."""
        r = self.join.resources
        rate = planned_rate(r.bytes_per_second, self.proven_rate, self.served_rate) * core_share
        memory = (
            min(r.free_memory_bytes, self.memory_cap)
            if self.memory_cap is not None
            else r.free_memory_bytes
        )
        devices = tuple(
            DeviceInfo(d.device, d.free_memory_bytes, d.bytes_per_second) for d in r.devices
        )
        return NodeInfo(
            self.node_id,
            memory,
            rate,
            f"{self.join.data_host}:{self.join.data_port}",
            r.device,
            devices,
        )

    def placement(self) -> Placement:
        r = self.join.resources
        return Placement(self.node_id, r.host, frozenset(r.cpus), r.device, self.address)
