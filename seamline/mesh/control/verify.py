"""Checking live frames: with ``--verify-fraction F`` the coordinator follows a random fraction F
of requests and holds their tokens until they check out, and for each one checks ONE stage,
chosen at random, on its own copy of that stage's layers only: it never holds the whole model.

Every stage of such a mesh reports a digest (``runtime.digest``) of every row it receives and
every row it computes, for every request: a commitment made before it can know which requests
are checked, or which stage of them, since the coordinator chooses both and tells no stage
beforehand. A stage of a checked mesh keeps the input rows of each request it holds
(``runtime.kept_inputs``); once a followed request has ended (its last token came) and its
stages have all reported its rows, the coordinator asks the chosen stage for the rows it took
(``KeptRowsAsk``; the answer comes in bounded parts, ``KeptRows``), so the choice is known to
that stage only after it committed to all of them. Stage 0's inputs are the request's tokens,
which the coordinator has, and no stage is asked. Row by row it checks:

- every link, for every stage (no computing): a stage's input digest against the output
  digest the stage before reports; where they differ, the sender's signed statement of that
  frame, which the receiver reports, says which of the two lied (``link_blame``);
- the rows the chosen stage shows: they must be what it reported taking (its input digest) and
  what its sender signed (the statement, ``frame_signing.signed_by``, and the rows' digest
  against the signed one): a stage cannot invent the inputs it is checked on;
- its output digest against the coordinator's run of its layers on those rows, on the
  coordinator's cache of that stage (it is at fault when they differ);
- when the chosen stage is the last, the drawn token against the coordinator's own draw from
  the same logits, seed and position (a near tie, where float rounding could flip it, passes).
  Other stages' tokens are the mesh's: the stage checked computed on them.

A lockstep group is one stage (its leader reports, keeps and shows its rows; the coordinator
runs the group's shards as the group does, ``reference_group``) and its every rank is blamed.

What the issue left open, decided here:
- The chosen stage is asked for its rows only once the request has ended. Asked while it
  runs, the chosen stage would learn it is checked on the rest of the request, and every
  other stage, not asked, that it is not: it could lie on the rest unseen. The cost: a
  followed request whose chosen stage is not stage 0 passes its tokens to its client only
  once it has ended and checked out (stage 0's checks run, and release, as its rows come).
- The choice is drawn when a request is followed, with ``secrets``; a re-plan replays the
  request as a new one, with a new choice. ``--verify-node NODE`` (tests) checks the stage
  NODE serves in.
- The coordinator loads a stage's layers when a followed request chooses it and lets them go
  when no followed request checks that stage any more (``Reference.keep_only``).
- A stage asked for rows it no longer shows (``gone``), or that does not answer, is asked
  again as its next digests come (a sequence started over meanwhile); after ``WAIT_S``
  without the rows it is at fault, as a stage that never reports its digests is. A stage
  keeps a request's rows a minute after stage 0 forgets its cache (``kept_inputs``), for the
  checks that run behind the mesh; past that or its cap, an honest stage could be blamed.
- Positions the reference runs to catch up (a fork of a prefix it never ran, or a sequence
  started over) are run on the rows the stage shows, unchecked: the prefix's own requests were
  checked, or not, when they ran. A forked request's kept rows begin with its donor's.
- In a plaintext mesh (nothing signed) the rows shown are held to the sender's reported output
  digest instead; a disagreement there blames both, as a link's does.

Until its row has checked out a checked request's token is held back, so a client of a checked
request never sees a token a member was caught lying about; the member is removed and the
request replays. A liar is caught on a followed request whose chosen stage is its own (or on
any followed request where it and a neighbour disagree on a link): with S stages and a
fraction F, each request it serves catches it with a chance of about F/S. Tokens it changed in
requests not caught reach their clients.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from seamline.mesh.control.link_blame import Statement
from seamline.mesh.control.reference import AnyStage, Reference
from seamline.mesh.control.verify_links import CheckedStage, CrossingChecks
from seamline.mesh.control.verify_shadow import Shadow, shown_part
from seamline.mesh.protocol.frame_signing import from_receipt
from seamline.net.frames import RowFlag, TokenRow
from seamline.net.messages import Digests, KeptRows, KeptRowsAsk, Message, Open
from seamline.runtime import digest
from seamline.runtime.grammar import TokenMasks, grammar_mask
from seamline.runtime.sampling import adjusted, draw

log = logging.getLogger("seamline.coordinator")
WAIT_S = 20.0  # a checked row's reports or shown rows missing by then: the silent stage is at fault
NEAR_TIE = {
    torch.float32: 1e-3,
    torch.bfloat16: 5e-2,
    torch.float16: 2e-2,
}  # logit gap a rounding may flip

Release = Callable[[list[TokenRow]], None]
Blame = Callable[[list[str], str], None]  # the nodes at fault, why
PublicKeysOf = Callable[[str], list[Any]]  # a node's certificate keys
Ask = Callable[[str, Message], None]  # a message to a member


class Verifier(CrossingChecks):
    def __init__(
        self,
        reference: Reference | None,
        fraction: float,
        release: Release,
        blame: Blame,
        masks: TokenMasks | None = None,
        public_keys: PublicKeysOf = lambda node: [],
        ask: Ask = lambda node, message: None,
        choice: str | None = None,
    ) -> None:
        """``reference``: the coordinator's copy (None: nothing is checked); ``public_keys``:
        a member's certificate keys, which sign its frames (none known: a plaintext mesh);
        ``ask``: sends a member a message; ``choice``: a node whose stage every followed request
        checks while it serves in one (tests; None: one at random)."""
        self.reference = reference
        self.public_keys = public_keys
        self.fraction = fraction if reference is not None else 0.0
        self.release, self.blame, self.ask = release, blame, ask
        self.masks = masks
        self.choice = choice
        self.seed = secrets.randbits(62) if self.fraction > 0 else 0
        self.stages: list[CheckedStage] = []
        self.plan_id = 0
        self._shadows: dict[int, Shadow] = {}
        self._statements: dict[int, Statement | None] = {}  # each stage's latest frame's
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
            "checking": [list(layers) for layers, _ in self._ref.loaded()]
            if self.reference
            else [],
        }

    # -- from the coordinator's threads ---------------------------------------------------
    def plan(self, stages: list[CheckedStage], plan_id: int) -> None:
        """A new route (``plan_id``'s, whose stages show their rows under it): requests in
        flight replay on it, as new requests."""
        if self.fraction > 0:
            self._events.put(lambda: self._replan(stages, plan_id))

    def opened(self, opening: Open, tokens: list[int]) -> None:
        if self.fraction > 0 and secrets.randbelow(1 << 30) < self.fraction * (1 << 30):
            self._events.put(lambda: self._follow(opening, tokens))

    def closed(self, request: int) -> None:
        if self.fraction > 0:
            self._events.put(lambda: self._drop(request))

    def digests(self, node_id: str, report: Digests) -> None:
        if self.fraction > 0:
            self._events.put(lambda: self._record(node_id, report))

    def kept_rows(self, node_id: str, part: KeptRows) -> None:
        """A part of the rows a chosen stage shows (``KeptRowsAsk``)."""
        if self.fraction > 0:
            self._events.put(lambda: self._shown(node_id, part))

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

    def _stage(self, index: int) -> AnyStage:
        """The coordinator's copy of stage ``index``'s layers (loaded when first checked)."""
        checked = self.stages[index]
        return self._ref.stage(checked.layers, len(checked.nodes))

    def _replan(self, stages: list[CheckedStage], plan_id: int) -> None:
        self.stages, self.plan_id = stages, plan_id
        self._shadows.clear()
        self._statements.clear()
        self._ref.keep_only([])

    def _follow(self, opening: Open, tokens: list[int]) -> None:
        if not self.stages:
            return
        chosen = next(
            (i for i, s in enumerate(self.stages) if self.choice in s.nodes),
            secrets.randbelow(len(self.stages)),
        )
        cache = self._stage(chosen).new_cache()
        self._shadows[opening.request] = Shadow(opening, list(tokens), chosen, cache)
        self.followed += 1

    def _drop(self, request: int) -> None:
        """``request`` is no longer followed: the layers no other followed request checks go."""
        if self._shadows.pop(request, None) is None:
            return
        checked = {self.stages[s.chosen] for s in self._shadows.values()}
        self._ref.keep_only([(s.layers, len(s.nodes)) for s in checked])

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
        if report.receipt is None:  # a frame's rows past the first report's come without it
            statement = self._statements.get(index)
        self._statements[index] = statement
        for (request, position, count), pair in zip(report.rows, values):
            shadow = self._shadows.get(request)
            if shadow is not None:
                if statement is not None and (request, position, count) in statement[0]:
                    shadow.statements.setdefault((position, count), {})[index] = statement
                shadow.rows.setdefault((position, count), {})[index] = pair
                shadow.seen.setdefault((position, count), time.monotonic())
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

    def _shown(self, node_id: str, part: KeptRows) -> None:
        """Rows the chosen stage shows: kept until its rows are checked."""
        shadow = self._shadows.get(part.request)
        if shadow is None or shadow.asked is None or part.plan_id != self.plan_id:
            return
        checked = self.stages[shadow.chosen]
        if node_id != checked.nodes[0] or part.layers != checked.layers:
            return
        if part.gone:  # asked again with its next digests (it may have started over)
            shadow.asked, shadow.arriving = None, bytearray()
            return
        stage = self._stage(shadow.chosen)
        try:
            rows = shown_part(shadow, part, stage.compute_dtype, tuple(stage.boundary_shape))
        except ValueError as exc:
            self._drop(part.request)
            self._fault([shadow.chosen], f"the rows it shows are malformed: {exc}")
            return
        if rows is not None:
            shadow.shown.keep(part.request, part.start, rows)
            shadow.asked, shadow.waiting_since = None, None
            self._advance(part.request, shadow)

    def _tokens(self, rows: list[TokenRow]) -> None:
        passed = []
        for row in rows:
            shadow = self._shadows.get(row.request)
            if shadow is None:
                passed.append(row)
                continue
            shadow.held.append(row)
            shadow.ended = shadow.ended or bool(row.flags & RowFlag.DONE)
            self._advance(row.request, shadow)
        if passed:
            self.release(passed)

    def _advance(self, request: int, shadow: Shadow) -> None:
        """Check every row of ``shadow`` whose stages have all reported (and whose inputs the
        chosen stage has shown), in order; release the tokens they drew once checked (which
        may make the next row checkable)."""
        while self._check_ready(shadow):
            known = len(shadow.tokens)
            self._release(shadow)
            if len(shadow.tokens) == known or request not in self._shadows:
                return

    def _check_ready(self, shadow: Shadow) -> bool:
        """Check the rows that can be; False when one failed (the request is dropped)."""
        while True:
            ready = [
                key
                for key, got in shadow.rows.items()
                if len(got) == len(self.stages) and key[0] + key[1] <= len(shadow.tokens)
            ]
            if not ready:
                return True
            position, count = min(ready)
            if not self._inputs_shown(shadow, position, count):
                return True  # the answer to an ask resumes this
            shadow.seen.pop((position, count), None)
            if not self._check_row(shadow, position, count, shadow.rows.pop((position, count))):
                self._drop(shadow.request)
                return False

    def _inputs_shown(self, shadow: Shadow, position: int, count: int) -> bool:
        """Whether the chosen stage's inputs for the row at ``position`` (and those the
        reference runs before it) are here; if not, and the request has ended, ask the stage
        for them, up to the end of the rows every stage reported, once. (Never before it ended:
        a stage not asked while a request runs would know it is not checked on its rest.)"""
        if shadow.chosen == 0:  # its inputs are the tokens
            return True
        start = shadow.run_from(position)
        if shadow.shown_rows(start, position + count) is not None:
            return True
        if shadow.asked is None and shadow.ended:
            reported = max(
                p + c for (p, c), got in shadow.rows.items() if len(got) == len(self.stages)
            )
            shadow.asked = (start, reported)
            if shadow.waiting_since is None:
                shadow.waiting_since = time.monotonic()
            checked = self.stages[shadow.chosen]
            ask = KeptRowsAsk(
                plan_id=self.plan_id,
                layers=checked.layers,
                request=shadow.request,
                start=start,
                end=reported,
            )
            self.ask(checked.nodes[0], ask)
        return False

    def _release(self, shadow: Shadow) -> None:
        """Pass on the held tokens whose rows checked out (and, where the chosen stage is the
        last, whose draw is the coordinator's)."""
        last = shadow.chosen == len(self.stages) - 1
        out = []
        for row in list(shadow.held):
            logits = shadow.logits.get(row.position)  # the chosen stage is the last: its draw
            checked = logits is not None if last else row.position <= shadow.checked_to
            if not checked:
                continue
            shadow.held.remove(row)
            if logits is not None and not self._check_token(shadow, row, logits):
                self._drop(row.request)
                return
            out.append(row)
            shadow.tokens[row.position : row.position + 1] = [row.token]
        if out:
            self.checked_tokens += len(out)
            self.release(out)

    def _check_row(
        self, shadow: Shadow, position: int, count: int, got: dict[int, torch.Tensor]
    ) -> bool:
        """Every link's digests, then the chosen stage's run of the row on the coordinator's
        copy of its layers, against what each stage reported."""
        for index in range(1, len(self.stages)):
            if not self._link_holds(shadow, index, position, count, got):
                return False
        self._catch_up(shadow, position)
        chosen, stage = shadow.chosen, self._stage(shadow.chosen)
        ids = torch.tensor(shadow.tokens[position : position + count], dtype=torch.long)
        x = ids if chosen == 0 else shadow.shown_rows(position, position + count)
        assert x is not None, "_inputs_shown let the row through"
        if chosen > 0 and not self._shown_holds(shadow, position, count, got, x):
            return False
        last = chosen == len(self.stages) - 1
        out = self._ref.run(stage, x, position, shadow.cache, last, ids)
        start = position + count - 1 if last else position
        gap = digest.differs(
            got[chosen][1],
            digest.digest(out, start, self.seed),
            digest.scale(out, start, self.seed),
            stage.compute_dtype,
            self._ref.rows_alone,
        )
        if gap > 1:
            return self._fault(
                [chosen],
                f"its output for positions [{position}, {position + count}) is "
                f"{gap:.0f}x the tolerance from the coordinator's",
            )
        shadow.next_position = shadow.checked_to = position + count
        if last:
            shadow.logits[position + count] = out[-1]
        return True

    def _catch_up(self, shadow: Shadow, position: int) -> None:
        """The mesh started the sequence over (preempted), or from a copy of a prefix the
        reference never ran: run the chosen stage on the positions before ``position``,
        unchecked (on the tokens, or on the rows the stage shows)."""
        start = shadow.run_from(position)
        if start < shadow.next_position:
            shadow.cache = self._stage(shadow.chosen).new_cache()
        shadow.next_position = start
        if position > start:
            ids = torch.tensor(shadow.tokens[start:position], dtype=torch.long)
            x = ids if shadow.chosen == 0 else shadow.shown_rows(start, position)
            assert x is not None, "_inputs_shown let the row through"
            last = shadow.chosen == len(self.stages) - 1
            self._ref.run(self._stage(shadow.chosen), x, start, shadow.cache, last, ids)
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
        """Rows held past WAIT_S: the stages that never reported them, or the chosen stage
        that never showed the rows it computed on, are at fault."""
        now = time.monotonic()
        for request, shadow in list(self._shadows.items()):
            late = [
                key
                for key, got in shadow.rows.items()
                if len(got) < len(self.stages) and now - shadow.seen[key] > WAIT_S
            ]
            if late and shadow.held:
                got = shadow.rows[min(late)]
                silent = [i for i in range(len(self.stages)) if i not in got]
                self._drop(request)
                self._fault(silent, f"it reported nothing of what it computed for {WAIT_S:.0f} s")
            elif shadow.waiting_since is not None and now - shadow.waiting_since > WAIT_S:
                self._drop(request)
                self._fault(
                    [shadow.chosen],
                    f"it showed none of the rows it computed on for {WAIT_S:.0f} s",
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
