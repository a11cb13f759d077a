"""Checking live frames: with ``--verify-fraction F`` the coordinator follows a random fraction F
of requests through its own copy of the model and holds their tokens until they check out.

Every stage of such a mesh reports a digest (``runtime.digest``) of every row it receives and
every row it computes, for every request: a commitment made before it can know which requests
are checked, since the coordinator chooses them and tells no stage. For a checked request the
coordinator runs the same rows through its own copy of each stage's layers (``reference``), in
the order the mesh ran them, and compares, row by row and stage by stage:

- a stage's output digest against its own (the stage computed something else: it is at fault);
- a stage's input digest against what the stage before should have sent (they disagree on
  what crossed the link between them): the sender's signed statement of that frame, which the
  receiver reports, says which of the two lied (``link_blame``); only that one is at fault;
- the drawn token against its own draw from the same logits, seed and position (the last
  stage drew something else; a near tie, where float rounding could flip the draw, passes).

Until its row has checked out a checked request's token is held back, so a client of a checked
request never sees a token a lying member made; the member is removed and the request replays.
Unchecked requests stream at once: with F below 1 a liar is found on the first checked request
it touches, and the tokens it changed in unchecked requests before that reach their clients.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from seamline.mesh.control.link_blame import Crossing, Statement, liars
from seamline.mesh.control.reference import Reference
from seamline.mesh.protocol.frame_signing import from_receipt
from seamline.net.frames import RowFlag, TokenRow
from seamline.net.messages import Digests, Open
from seamline.runtime import digest
from seamline.runtime.grammar import TokenMasks, grammar_mask
from seamline.runtime.sampling import adjusted, draw

log = logging.getLogger("seamline.coordinator")
WAIT_S = (
    20.0  # a checked row whose stages have not all reported by then: the silent ones are at fault
)
NEAR_TIE = {
    torch.float32: 1e-3,
    torch.bfloat16: 5e-2,
    torch.float16: 2e-2,
}  # logit gap a rounding may flip

Release = Callable[[list[TokenRow]], None]
Blame = Callable[[list[str], str], None]  # the nodes at fault, why
PublicKeysOf = Callable[[str], list[Any]]  # a node's certificate keys


@dataclass(frozen=True)
class CheckedStage:
    layers: tuple[int, int]
    nodes: tuple[str, ...]  # its leader first (who reports), then a group's other ranks


@dataclass
class Shadow:
    """A checked request as the coordinator computes it."""

    opening: Open
    tokens: list[int]  # prompt, then the tokens drawn so far (the mesh's)
    caches: list[object]
    began: float = field(default_factory=time.monotonic)
    next_position: int = 0  # the reference has run the positions before this
    rows: dict[tuple[int, int], dict[int, torch.Tensor]] = field(
        default_factory=dict
    )  # (position, count) -> stage -> [2, W]
    logits: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # position drawn for -> the reference's logits
    held: list[TokenRow] = field(default_factory=list)
    statements: dict[tuple[int, int], dict[int, Statement]] = field(
        default_factory=dict
    )  # (position, count) -> receiving stage -> the statement of the frame it came in


class Verifier:
    def __init__(
        self,
        reference: Reference | None,
        fraction: float,
        release: Release,
        blame: Blame,
        masks: TokenMasks | None = None,
        public_keys: PublicKeysOf = lambda node: [],
    ) -> None:
        """``reference``: the coordinator's copy (None: nothing is checked); ``public_keys``:
        a member's certificate keys, which sign its frames (none known: a plaintext mesh)."""
        self.reference = reference
        self.public_keys = public_keys
        self.fraction = fraction if reference is not None else 0.0
        self.release, self.blame = release, blame
        self.masks = masks
        self.seed = secrets.randbits(62) if self.fraction > 0 else 0
        self.stages: list[CheckedStage] = []
        self._shadows: dict[int, Shadow] = {}
        self._events: queue.Queue[Callable[[], None]] = queue.Queue()
        self.checked_tokens = self.violations = self.followed = 0
        self.expelled: list[
            str
        ] = []  # nodes found computing something else (here or at start-up), in order
        if self.fraction > 0:
            threading.Thread(target=self._run, name="seamline-verify", daemon=True).start()

    def describe(self) -> dict[str, object]:
        """For /api/status: how much is checked and what was found."""
        return {
            "fraction": self.fraction,
            "followed": self.followed,
            "checked_tokens": self.checked_tokens,
            "violations": self.violations,
            "expelled": list(self.expelled),
        }

    # -- from the coordinator's threads ---------------------------------------------------
    def plan(self, stages: list[CheckedStage]) -> None:
        """A new route: requests in flight replay on it, as new requests."""
        if self.fraction > 0:
            self._events.put(lambda: self._replan(stages))

    def opened(self, opening: Open, tokens: list[int]) -> None:
        if self.fraction > 0 and secrets.randbelow(1 << 30) < self.fraction * (1 << 30):
            self._events.put(lambda: self._follow(opening, tokens))

    def closed(self, request: int) -> None:
        if self.fraction > 0:
            self._events.put(lambda: self._shadows.pop(request, None))

    def digests(self, node_id: str, report: Digests) -> None:
        if self.fraction > 0:
            self._events.put(lambda: self._record(node_id, report))

    def tokens(self, rows: list[TokenRow]) -> None:
        """Tokens from the drawing stage: held for checked requests, passed on for the rest."""
        if self.fraction <= 0:
            self.release(rows)
            return
        self._events.put(lambda: self._tokens(rows))

    # -- the verifier's thread ------------------------------------------------------------
    @property
    def _ref(self) -> Reference:
        assert self.reference is not None, "the verifier's thread runs only with a reference"
        return self.reference

    def _run(self) -> None:
        while True:
            try:
                event = self._events.get(timeout=1.0)
            except queue.Empty:
                self._overdue()
                continue
            try:
                event()
            except Exception:  # a check that cannot run fails no request; it is logged
                log.exception("verification failed to run")

    def _replan(self, stages: list[CheckedStage]) -> None:
        self.stages = stages
        self._shadows.clear()
        self._ref.keep_only([(s.layers, len(s.nodes)) for s in stages])

    def _follow(self, opening: Open, tokens: list[int]) -> None:
        if self.stages:
            caches = [self._ref.stage(s.layers, len(s.nodes)).new_cache() for s in self.stages]
            self._shadows[opening.request] = Shadow(opening, list(tokens), caches)
            self.followed += 1

    def _record(self, node_id: str, report: Digests) -> None:
        index = next(
            (
                i
                for i, s in enumerate(self.stages)
                if s.nodes[0] == node_id and s.layers == report.layers
            ),
            None,
        )
        if index is None:
            return
        try:
            values = digest.unpack(report.digests, len(report.rows), 2)
        except ValueError as exc:
            self._fault([index], f"its digests are malformed: {exc}")
            return
        statement = self._statement(index, report)
        for (request, position, count), pair in zip(report.rows, values):
            shadow = self._shadows.get(request)
            if shadow is not None:
                if statement is not None and (request, position, count) in statement[0]:
                    shadow.statements.setdefault((position, count), {})[index] = statement
                shadow.rows.setdefault((position, count), {})[index] = pair
                self._advance(request, shadow)

    def _statement(self, index: int, report: Digests) -> Statement | None:
        """The statement a stage reports for the frame its rows came in (None: none, or
        malformed: either leaves it unable to show what it was sent)."""
        if report.receipt is None or index == 0:
            return None
        try:
            return from_receipt(report.receipt)
        except ValueError:
            return None

    def _tokens(self, rows: list[TokenRow]) -> None:
        passed = []
        for row in rows:
            shadow = self._shadows.get(row.request)
            if shadow is None:
                passed.append(row)
                continue
            shadow.held.append(row)
            self._advance(row.request, shadow)
        if passed:
            self.release(passed)

    def _advance(self, request: int, shadow: Shadow) -> None:
        """Check every row of ``shadow`` whose stages have all reported, in order; release the
        tokens they drew once checked."""
        while True:
            ready = [
                key
                for key, got in shadow.rows.items()
                if len(got) == len(self.stages) and key[0] + key[1] <= len(shadow.tokens)
            ]
            if not ready:
                break
            position, count = min(ready)
            if not self._check_row(shadow, position, count, shadow.rows.pop((position, count))):
                self._shadows.pop(request, None)
                return
        self._release(shadow)

    def _release(self, shadow: Shadow) -> None:
        out = []
        for row in list(shadow.held):
            logits = shadow.logits.get(row.position)
            if logits is None:
                continue
            shadow.held.remove(row)
            if not self._check_token(shadow, row, logits):
                self._shadows.pop(row.request, None)
                return
            out.append(row)
            shadow.tokens[row.position : row.position + 1] = [row.token]
        if out:
            self.checked_tokens += len(out)
            self.release(out)

    def _check_row(
        self, shadow: Shadow, position: int, count: int, got: dict[int, torch.Tensor]
    ) -> bool:
        """Run the row through the reference, stage by stage, against what each stage reported."""
        self._catch_up(shadow, position)
        ids = torch.tensor(shadow.tokens[position : position + count], dtype=torch.long)
        x: torch.Tensor = ids
        for index, checked in enumerate(self.stages):
            stage = self._ref.stage(checked.layers, len(checked.nodes))
            if (
                index > 0
                and digest.differs(
                    got[index][0],
                    digest.digest(x, position, self.seed),
                    digest.scale(x, position, self.seed),
                    stage.compute_dtype,
                    self._ref.rows_alone,
                )
                > 1
                and not self._link_holds(shadow, index, position, count, got[index][0], x)
            ):
                return False
            last = index == len(self.stages) - 1
            x = self._ref.run(stage, x, position, shadow.caches[index], last, ids)
            start = position + count - 1 if last else position
            gap = digest.differs(
                got[index][1],
                digest.digest(x, start, self.seed),
                digest.scale(x, start, self.seed),
                stage.compute_dtype,
                self._ref.rows_alone,
            )
            if gap > 1:
                return self._fault(
                    [index],
                    f"its output for positions [{position}, {position + count}) is "
                    f"{gap:.0f}x the tolerance from the coordinator's",
                )
        shadow.next_position = position + count
        shadow.logits[position + count] = x[-1]
        return True

    def _catch_up(self, shadow: Shadow, position: int) -> None:
        """The mesh started the sequence over (preempted), or from a copy of a prefix the
        reference never ran: compute the positions before ``position`` unchecked."""
        if position < shadow.next_position:
            shadow.caches = [
                self._ref.stage(s.layers, len(s.nodes)).new_cache() for s in self.stages
            ]
            shadow.next_position = 0
        if position > shadow.next_position:
            ids = torch.tensor(shadow.tokens[shadow.next_position : position], dtype=torch.long)
            x: torch.Tensor = ids
            for index, checked in enumerate(self.stages):
                x = self._ref.run(
                    self._ref.stage(checked.layers, len(checked.nodes)),
                    x,
                    shadow.next_position,
                    shadow.caches[index],
                    index == len(self.stages) - 1,
                    ids,
                )
            shadow.next_position = position

    def _check_token(self, shadow: Shadow, row: TokenRow, logits: torch.Tensor) -> bool:
        opening = shadow.opening
        params = opening.sampling
        output = shadow.tokens[opening.prompt_len : row.position]
        allowed = (
            grammar_mask(self.masks, row.request, params, output, logits.shape[-1])
            if self.masks
            else None
        )
        expected = draw(logits, params, params.seed or 0, row.position, output, allowed).token
        stopped = bool(row.flags & RowFlag.STOPPED)
        if row.token == expected or (
            not stopped and _near_tie(logits, params, output, row.token, expected, self._ref.dtype)
        ):
            return True
        return self._fault(
            [len(self.stages) - 1],
            f"it drew token {row.token} at position {row.position} where the "
            f"coordinator draws {int(expected)}",
        )

    def _overdue(self) -> None:
        """Rows held past WAIT_S: the stages that never reported them are at fault."""
        now = time.monotonic()
        for request, shadow in list(self._shadows.items()):
            late = [key for key, got in shadow.rows.items() if len(got) < len(self.stages)]
            if late and now - shadow.began > WAIT_S and shadow.held:
                got = shadow.rows[min(late)]
                silent = [i for i in range(len(self.stages)) if i not in got]
                self._shadows.pop(request, None)
                self._fault(silent, f"it reported nothing of what it computed for {WAIT_S:.0f} s")

    def _link_holds(
        self,
        shadow: Shadow,
        index: int,
        position: int,
        count: int,
        reported: torch.Tensor,
        x: torch.Tensor,
    ) -> bool:
        """Stage ``index`` took something else than stage ``index - 1``'s layers make of the
        row: the one of the two that lied is at fault (``link_blame``). True when the signed
        statement shows they agree after all."""
        sender = self.stages[index - 1].nodes[0]
        row = (shadow.opening.request, position, count)
        crossing = Crossing(
            row,
            reported,
            digest.digest(x, position, self.seed),
            digest.scale(x, position, self.seed),
            self._ref.stage(self.stages[index].layers, len(self.stages[index].nodes)).compute_dtype,
            self._ref.rows_alone,
        )
        statement = shadow.statements.get((position, count), {}).get(index)
        who, why = liars(crossing, sender, self.public_keys(sender), self.seed, statement)
        if not who:
            return True
        places = {"sender": index - 1, "receiver": index}
        return self._fault(
            [places[w] for w in who],
            f"what crossed to layers {self.stages[index].layers} for positions "
            f"[{position}, {position + count}) is not what crossed from the stage before: {why}",
        )

    def _fault(self, indexes: list[int], reason: str) -> bool:
        """The stages at ``indexes`` are at fault (the row's check ends here): their nodes are
        blamed, once (rows of the old plan still checked after a node's removal say no more)."""
        self.violations += 1
        nodes = [n for i in indexes for n in self.stages[i].nodes if n not in self.expelled]
        if nodes:
            log.error("verification: %s: %s", ", ".join(nodes), reason)
            self.blame(nodes, reason)
        return False


def _near_tie(
    logits: torch.Tensor,
    params: object,
    output: list[int],
    token: int,
    expected: int,
    dtype: torch.dtype,
) -> bool:
    """Whether float rounding could have made a stage draw ``token`` where the reference drew
    ``expected``: their adjusted logits within the path's rounding of each other."""
    choices = adjusted(logits, params, output).float()  # type: ignore[arg-type]
    if not 0 <= token < choices.shape[-1]:
        return False
    return float(choices[expected] - choices[token]) <= NEAR_TIE.get(dtype, 1e-3)
