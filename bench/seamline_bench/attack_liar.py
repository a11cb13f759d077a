"""A lying member (`seamline bench fuzz`'s ``attacks``): a real ``Node`` of the mesh, changed as an
attacker would change it (moved here from tests/mesh/test_mesh_checks.py and test_mesh_members.py).
It serves honestly until the bench writes ``arm`` on its stdin; then, by ``mode``:

- ``fake_ready``: it loads nothing and reports READY (armed from the start: it joins a serving
  mesh, claiming a machine of its own, as a node on another host would, so the mesh plans it in);
- ``perturbed_hidden``: its stage scales what it computes for live frames by 1.05 (the
  coordinator's start-up probe still sees honest answers);
- ``forged_tokens``: for every request it sees (unless it is the stage that draws them), it
  sends a TOKEN frame ending the answer with a token of its choosing; a second member outside
  the route, told the request ids, forges the same tokens;
- ``forged_reports``: for every request it sees, as it opens, it reports that it failed on it
  (a planned member's report replays the request) and that the request is at fault (what only
  stage 0 and the drawing stage may say);
- ``stalled_reader``: it stops reading its control link, and goes on sending heartbeats.
- ``claimed_resources``: it claims ten times its speed, 1 TB of memory and a machine of its own,
  and serves honestly (``attack_claims``).

Lines to the bench: ``{"joined": t}``, ``{"armed": t}``, and on ``quit`` ``{"result": ...}``.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from seamline.mesh.node.fetch import FetchReport
from seamline.mesh.node.process import Node, NodeOptions
from seamline.mesh.protocol.invite import Invite
from seamline.net.frames import EMPTY_HASH, RowFlag, TokenRow
from seamline.net.link import LinkClosed
from seamline.net.messages import Failure, Heartbeat, Open
from seamline_bench import attack_blame
from seamline_bench.attack_claims import claims_more_than_it_has
from seamline_bench.attack_member import AttackRefused, _address, emit, member


class Liar:
    def __init__(self, target: dict[str, Any], mode: str) -> None:
        self.target, self.mode = target, mode
        self.armed = threading.Event()
        self.seen: collections.deque[int] = collections.deque(
            maxlen=256
        )  # request ids, as they opened here
        self.counts: collections.Counter[str] = collections.Counter()
        options = NodeOptions(
            max_memory_bytes=int(target["max_memory_bytes"]),
            node_id=target["node_id"],
            cache_dir=Path(target["cache_dir"]),
            progress=False,
        )
        self.node = Node(Invite.decode(target["invite"]), options)

    def run(self) -> None:
        if self.mode == "fake_ready":
            _claims_a_machine_of_its_own()
            _loads_nothing()
            self.armed.set()
        elif self.mode == "perturbed_hidden":
            _perturbs_live_frames(self.node, self.armed)
        elif self.mode == attack_blame.MODE:
            attack_blame.alters_sent_frames(self.node, self.armed, self.counts)
        elif self.mode == "claimed_resources":
            claims_more_than_it_has()
        self._watch_opens()
        self.node.join()
        threading.Thread(target=self._serve, daemon=True).start()
        emit({"joined": time.monotonic(), "node_id": self.node.options.node_id})
        for line in sys.stdin:
            if line.strip() == "arm":
                self.armed.set()
                emit({"armed": time.monotonic()})
                if self.mode in ("forged_tokens", "forged_reports"):
                    threading.Thread(target=self._forge, daemon=True).start()
                elif self.mode == "stalled_reader":
                    self._stall()
            elif line.strip() == "quit":
                break
        emit({"result": {"mode": self.mode, **self.counts}})

    def _serve(self) -> None:
        try:
            self.node.serve()
        except Exception as exc:  # removed, refused: the bench reads what the mesh did
            self.counts[f"serve ended: {type(exc).__name__}"] += 1
        self.counts["served until removed"] += 1

    def _watch_opens(self) -> None:
        """Record the request ids this stage is sent (stage 0 on its control link, a later stage
        on its data link), as a member of the route sees them."""
        node = self.node
        on_control, on_frame = node._on_control, node._on_frame

        def control(message: Any) -> None:
            if isinstance(message, Open):
                self.seen.append(message.request)
            on_control(message)

        def frame(incoming: Any, peer: str, role: str) -> None:
            if isinstance(incoming, Open):
                self.seen.append(incoming.request)
            on_frame(incoming, peer, role)

        node._on_control, node._on_frame = control, frame  # type: ignore[method-assign,assignment]

    def _forge(self) -> None:
        """Every request seen since the last round: forged tokens (from this stage unless it draws
        them, and from a member outside the route), or forged reports."""
        outsider = self._outsider() if self.mode == "forged_tokens" else None
        done: set[int] = set()
        while True:
            fresh = [r for r in list(self.seen) if r not in done]
            done.update(fresh)
            try:
                for request in fresh:
                    if self.mode == "forged_reports":
                        self._report(request)
                    else:
                        self._tokens(request, outsider)
            except LinkClosed:
                self.counts["forging link closed"] += 1
                return
            time.sleep(0.05)

    def _outsider(self) -> Any:
        try:
            return member(
                _address(self.target["control"]), self.target["outsider_invite"], "forger"
            ).start()
        except (AttackRefused, OSError, LinkClosed) as exc:
            self.counts[f"outsider not admitted: {exc}"[:80]] += 1
            return None

    def _tokens(self, request: int, outsider: Any) -> None:
        forged = [
            TokenRow(
                request=request,
                position=40,
                token=42,
                hash_before=EMPTY_HASH,
                hash_after=1,
                flags=int(RowFlag.DONE),
            )
        ]
        assignment, control = self.node.assignment, self.node.control
        if assignment is not None and assignment.owns_head:
            self.counts["not forged in the route: it draws"] += 1
        elif control is not None:
            control.send_tokens(forged)
            self.counts["tokens_forged_in_route"] += 1
        if outsider is not None:
            outsider.link.send_tokens(forged)
            self.counts["tokens_forged_outside_route"] += 1

    def _report(self, request: int) -> None:
        control = self.node.control
        if control is None:
            return
        control.send_message(Failure(request=request, reason="this stage failed", blame="node"))
        control.send_message(
            Failure(request=request, reason="the request is invalid", blame="request")
        )
        self.counts["reports_forged"] += 2

    def _stall(self) -> None:
        """Read nothing more on the control link; keep sending heartbeats, so it never seems silent."""
        control = self.node.control
        assert control is not None
        never = threading.Event()

        def stalled(*_args: Any, **_kwargs: Any) -> Any:
            never.wait()

        control.recv = stalled  # type: ignore[method-assign]

        def beat() -> None:
            try:
                while True:
                    control.send_message(Heartbeat())
                    self.counts["heartbeats_sent_while_stalled"] += 1
                    time.sleep(0.3)
            except LinkClosed:
                self.counts["control link closed by the coordinator"] += 1

        threading.Thread(target=beat, daemon=True).start()


def _claims_a_machine_of_its_own() -> None:
    """Its join reports another machine (as a node on another host does): its CPUs are not
    shared with the honest nodes', so a plan with it looks faster."""
    from seamline.mesh.node import membership

    honest = membership.local_resources
    membership.local_resources = lambda options: honest(options).model_copy(
        update={"host": "attacker-host"}
    )
    _dials_from_another_address()


def _dials_from_another_address(address: str = "127.0.0.2") -> None:
    """Its links come from another loopback address (all of 127/8 is this machine's), as a node
    on another host's do: the coordinator takes nodes at one address to share a machine."""
    import socket

    real = socket.create_connection

    def dial(target: Any, timeout: Any = None, source_address: Any = None, **rest: Any) -> Any:
        if source_address is None and target[0] in ("127.0.0.1", "localhost"):
            source_address = (address, 0)
        if timeout is None:
            return real(target, source_address=source_address, **rest)
        return real(target, timeout, source_address, **rest)

    socket.create_connection = dial  # type: ignore[assignment]


def _loads_nothing() -> None:
    """It takes its assignment, allocates its layers' shapes without reading a weight (it knows
    the model's shapes), and reports READY as if it had loaded them."""
    from seamline.app import default_model_path
    from seamline.config import ModelConfig
    from seamline.mesh.node import loading
    from seamline.ownership import Ownership
    from seamline.weights.loader import build_stage, open_source

    config = ModelConfig.from_hf_dict(open_source(default_model_path()).config_dict())

    def fake_load(invite: object, assign: Any, *rest: object) -> tuple[object, FetchReport]:
        stage = build_stage(config, Ownership(layers=tuple(assign.layers)))
        return stage.to_empty(device="cpu"), FetchReport()  # memory as it was left: no weight read

    loading.load_assignment = fake_load  # type: ignore[assignment]


def _perturbs_live_frames(node: Node, armed: threading.Event) -> None:
    """Once armed, its stage scales what it computes for live frames by 1.05: the hidden states
    it sends (or the logits it draws from). A start-up probe is computed honestly."""
    load = node._load
    live = threading.local()

    def tampered_load(assign: Any) -> None:
        load(assign)
        worker = node.worker
        assert worker is not None
        forward, run_batch = worker.stage.forward_batch, worker.run_batch

        def forward_batch(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = forward(*args, **kwargs)
            return out * 1.05 if armed.is_set() and getattr(live, "on", False) else out

        def live_batch(work: list[Any]) -> list[Any]:
            live.on = True
            try:
                return run_batch(work)
            finally:
                live.on = False

        worker.stage.forward_batch = forward_batch  # type: ignore[method-assign]
        worker.run_batch = live_batch  # type: ignore[method-assign]

    node._load = tampered_load  # type: ignore[method-assign]
