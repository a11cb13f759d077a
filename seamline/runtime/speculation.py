"""Speculative decoding: drafts from the sequence's own n-grams, verified in the step that
computes its next token.

A decoding sequence's row becomes a window: its last token and ``k`` drafted tokens, ``k + 1``
rows of one span. The token for each position is then drawn from that row's logits by the one
sampler (``sampling.draw_next``): greedy takes the argmax, a seeded draw takes the randomness
of (seed, position) alone, so no draw depends on what was drafted. A draft is accepted while
it equals the draw for its position; the first draw that differs (or the one after the last
draft) ends the window. The output is therefore the output without speculation, apart from
near ties where the arithmetic of ``k + 1`` rows differs from one row's in the last bits.

Rejected drafts cost nothing to undo: a cache is written at explicit positions, and nothing
past the positions the scheduler counts as cached is read (``model/cache.py``).

Drafts come from prompt lookup: the longest recent n-gram at the end of the sequence that
occurred before, and the tokens that followed it then (no extra model). The draft length
adapts to what was accepted, and drafting pauses for a while (longer each time) after windows
that accepted nothing or while the sequence accepts too few drafts for what their rows cost
(measured: ``StepCost``; ``MARGIN``); a step drafts only into rows it has to spare (``SPARE_STEP_ROWS``), so a step already
full of other sequences' rows drafts little or nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from seamline.errors import ConfigError

if TYPE_CHECKING:  # torch is not imported here: a node sets its OpenMP spin before torch loads
    import torch

    from seamline.runtime.sampling import TokenEvent

MODES = ("auto", "ngram", "mtp", "off")  # auto: what the model offers (its MTP layer, else n-grams)
DRAFT_MAX = 8  # the default and the most tokens one window drafts
DRAFT_LIMIT = 32
NGRAM_MAX, NGRAM_MIN = 4, 2  # the longest and shortest suffix looked up
SPARE_STEP_ROWS = 16  # a step's rows (decode rows and drafts) up to which drafts ride along
MAX_PAUSE_STEPS = 32  # the longest pause of drafting after windows that did not pay
ROW_COST = 0.3  # a draft's row, in one-row steps, until measured (the embedded model on 2 threads: 5.2 ms, +1.5 ms a row)
CHEAP_ROW_COST = 0.15  # rows this cheap (a step waits on links): one-token n-grams are drafted too
DECAY = 0.7  # the weight of a sequence's earlier windows in its acceptance
MARGIN = (
    2.0  # drafting goes on while a draft is accepted this many times more often than its row costs
)
COST_DECAY = 0.9  # the weight of earlier steps in the measured step times


DraftSource = Callable[
    [list[int], int], list[int]
]  # (prompt + tokens so far, the most to draft) -> drafts


def ngram_draft(
    history: list[int], limit: int, longest: int = NGRAM_MAX, shortest: int = NGRAM_MIN
) -> list[int]:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest suffix
    of ``history`` (``longest`` down to ``shortest`` tokens); [] when none occurred before."""
    if limit <= 0 or len(history) <= shortest:
        return []
    tokens = np.asarray(history, dtype=np.int64)
    for n in range(min(longest, len(tokens) - 1), shortest - 1, -1):
        earlier = sliding_window_view(tokens[:-1], n)  # every n-gram that has a token after it
        hits = np.flatnonzero((earlier == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + limit].tolist()
    return []


def offered_only(history: list[int], limit: int) -> list[int]:
    """The source where a model drafts (``Drafter.offered``, after each step): none from the history."""
    return []


@dataclass(frozen=True)
class Speculation:
    """How a server speculates (``--speculative``, ``--draft-max``); ``source`` drafts."""

    mode: str = "auto"
    draft_max: int = DRAFT_MAX
    source: DraftSource = ngram_draft
    draft_model: str | None = (
        None  # a smaller model that drafts (``runtime/draft_model.py``; one process)
    )

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"--speculative {self.mode!r}: choose one of {', '.join(MODES)}")
        if not 1 <= self.draft_max <= DRAFT_LIMIT:
            raise ConfigError(
                f"--draft-max {self.draft_max}: a window drafts 1 to {DRAFT_LIMIT} tokens"
            )
        if self.draft_model is not None and self.mode not in ("auto", "ngram"):
            raise ConfigError(
                f"--draft-model drafts in place of n-grams: not with --speculative {self.mode}"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def for_model(self, drafts_itself: bool) -> Speculation:
        """As it speculates over a model that has (``drafts_itself``) a multi-token-prediction
        layer or not: ``auto`` takes the layer where there is one; ``mtp`` needs it."""
        if self.draft_model is not None:
            return (
                self  # the draft model drafts (``serve_local.local_backend`` gives it the source)
            )
        if self.mode == "mtp" and not drafts_itself:
            raise ConfigError(
                "--speculative mtp: the model has no multi-token-prediction layer here"
            )
        if self.mode in ("auto", "mtp") and drafts_itself:
            return replace(self, mode="mtp", source=offered_only)
        return self


OFF = Speculation("off")
CONFIG_METHODS = {"ngram": "ngram", "mtp": "mtp", "deepseek_mtp": "mtp"}  # vLLM's names -> a mode
CONFIG_NUMBERS = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
DRAFT_MODEL_METHOD = "draft_model"  # vLLM's method for {"model": PATH}


def from_config(text: str) -> Speculation:
    """``--speculative-config`` as vLLM takes it: a JSON object with ``method`` (or ``model``, a
    draft model's path: method ``draft_model``) and optionally ``num_speculative_tokens`` (the
    draft length) and, for n-grams, ``prompt_lookup_max`` and ``prompt_lookup_min`` (the longest
    and shortest suffix looked up); one clear error for anything else."""
    import json
    from functools import partial

    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError('--speculative-config takes a JSON object, such as {"method": "ngram"}')
    unknown = sorted(set(config) - {"method", "model", *CONFIG_NUMBERS})
    if unknown:
        raise ConfigError(
            f"--speculative-config: {unknown[0]!r} is not taken here (method, model, {', '.join(CONFIG_NUMBERS)})"
        )
    for key in CONFIG_NUMBERS:
        if key in config and (
            not isinstance(config[key], int) or isinstance(config[key], bool) or config[key] < 0
        ):
            raise ConfigError(f"--speculative-config: {key} {config[key]!r} is not a whole number")
    draft_max = config.get("num_speculative_tokens", DRAFT_MAX)
    model = config.get("model")
    method = config.get("method", DRAFT_MODEL_METHOD if model is not None else None)
    if (method == DRAFT_MODEL_METHOD) != isinstance(model, str):
        raise ConfigError(
            f"--speculative-config: a draft model takes method {DRAFT_MODEL_METHOD!r} (or none) and "
            f'"model": its path; got method {method!r} and model {model!r}'
        )
    if model is not None:
        return Speculation("auto", draft_max, draft_model=model)
    if method not in CONFIG_METHODS:
        raise ConfigError(
            f"--speculative-config: method {method!r}: choose one of "
            f"{', '.join([*CONFIG_METHODS, DRAFT_MODEL_METHOD])}"
        )
    longest, shortest = (
        config.get("prompt_lookup_max", NGRAM_MAX),
        config.get("prompt_lookup_min", NGRAM_MIN),
    )
    if not 1 <= shortest <= longest:
        raise ConfigError(
            f"--speculative-config: prompt_lookup_min {shortest} and prompt_lookup_max {longest}: "
            "1 <= min <= max"
        )
    if (longest, shortest) == (NGRAM_MAX, NGRAM_MIN):
        return Speculation(CONFIG_METHODS[method], draft_max)
    return Speculation(
        CONFIG_METHODS[method], draft_max, partial(ngram_draft, longest=longest, shortest=shortest)
    )


@dataclass
class Drafter:
    """One sequence's drafting: the window it is verifying and how long the next may be."""

    draft_max: int
    source: DraftSource = ngram_draft
    length: int = 0  # the next window's length (0: start at draft_max)
    pause: int = 0  # steps left without drafting
    misses: int = 0  # windows in a row that did not pay
    hits: float = 0.0  # drafts accepted, decayed by DECAY each window
    tries: float = 0.0  # drafts checked (the accepted and the first rejected), likewise
    window: list[int] = field(default_factory=list)  # drafts being verified
    accepted: int = 0  # of ``window``, accepted so far
    offered: list[int] | None = (
        None  # drafts a model made for the next window (``runtime/mtp_drafts.py``)
    )
    full: bool = False  # the last window's drafts were all accepted
    ends: list[int] = field(
        default_factory=list
    )  # where each window in flight ends in ``window`` (a pipeline's)

    def wanted(self) -> int:
        """How many tokens the next window may draft (0 while drafting pauses)."""
        return 0 if self.pause > 0 else self.length or self.draft_max

    def propose(self, history: list[int], room: int, row_cost: float = ROW_COST) -> list[int]:
        """The drafts for the next window, at most ``room`` tokens; where rows are cheap, from
        a one-token match too when no longer one occurred."""
        offered, self.offered = self.offered, None
        if self.pause > 0:
            self.pause -= 1
            return []
        limit = min(room, self.length or self.draft_max)
        drafts = offered[:limit] if offered is not None else self.source(history, limit)
        if not drafts and row_cost < CHEAP_ROW_COST and self.source is ngram_draft:
            drafts = ngram_draft(history, limit, shortest=1)
        self.window, self.accepted = drafts[: max(0, room)], 0
        self.ends = [len(self.window)] if self.window else []
        return self.window

    @property
    def in_flight(self) -> int:
        """Windows sent whose draws are not all in: the draw after a window's last row checks
        the next window's first draft, so a window is done once that one is accepted."""
        return sum(1 for end in self.ends if self.accepted <= end)

    @property
    def pending(self) -> int:
        """Drafts in flight: sent, and not yet accepted or rejected."""
        return len(self.window) - self.accepted

    def follow(self, history: list[int], room: int) -> list[int]:
        """Drafts that go on from the window in flight (``history``: the tokens so far and its
        drafts not yet checked), as if they are all accepted: one window more of a pipeline's
        (``PipelineHead._ready`` says when). They join the window: a draw goes on checking
        against them; the first rejection drops them all."""
        if not self.window or room <= 0:
            return []
        source = (
            ngram_draft if self.source is offered_only else self.source
        )  # a model drafts after its tokens only
        drafts = source(history, min(room, self.length or self.draft_max))
        self.window += drafts
        if drafts:
            self.ends.append(len(self.window))
        return drafts

    def check(self, token: int) -> bool:
        """Whether the token just drawn is the next draft (its row then holds a valid position)."""
        if self.accepted < len(self.window) and token == self.window[self.accepted]:
            self.accepted += 1
            return True
        return False

    def close(self, row_cost: float = ROW_COST) -> tuple[int, int]:
        """End the window; (drafted, accepted), and the next window's length from them: shorter,
        and a pause, while its sequence accepts drafts less than ``MARGIN`` times as often as a
        draft's row costs (break-even, measured: a sampled story lost 4% there)."""
        drafted, accepted = len(self.window), self.accepted
        self.window, self.accepted, self.ends = [], 0, []
        self.full = 0 < drafted == accepted
        if not drafted:
            return 0, 0
        self.hits = DECAY * self.hits + accepted
        self.tries = DECAY * self.tries + accepted + (accepted < drafted)
        if (
            accepted == 0 or self.hits < MARGIN * row_cost * self.tries
        ):  # at break-even a draft saves nothing
            self.misses += 1
            self.length = max(1, (self.length or self.draft_max) // 2)
            self.pause = min(MAX_PAUSE_STEPS, 2 ** (self.misses - 1)) if self.misses > 1 else 0
        else:
            self.misses = 0
            grown = 2 * drafted if accepted == drafted else accepted + 1
            self.length = min(self.draft_max, grown)
        return drafted, accepted


@dataclass
class StepCost:
    """What a draft's row costs, in one-row steps, measured: the time from a sequence's rows
    being planned to its tokens recorded (a forward here, or a pipeline's round trip), for
    steps where it ran alone: one row, and windows of more (their time over one row's, per
    extra row). Until both are measured, ``ROW_COST``."""

    one_row_s: float = 0.0
    per_row_s: float = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        if rows == 1:
            self.one_row_s = (
                seconds
                if not self.one_row_s
                else COST_DECAY * self.one_row_s + (1 - COST_DECAY) * seconds
            )
        elif self.one_row_s:
            extra = max(0.0, seconds - self.one_row_s) / (rows - 1)
            self.per_row_s = (
                extra
                if not self.per_row_s
                else COST_DECAY * self.per_row_s + (1 - COST_DECAY) * extra
            )

    @property
    def row_cost(self) -> float:
        if not self.one_row_s or not self.per_row_s:
            return ROW_COST
        return min(1.0, self.per_row_s / self.one_row_s)


@dataclass
class SpeculationStats:
    """Windows verified, tokens drafted and accepted, since start (``/metrics``)."""

    windows: int = 0
    drafted: int = 0
    accepted: int = 0
    follows: int = 0  # windows sent on while one of the sequence's was in flight (a pipeline's)
    stale: int = (
        0  # of those, found stale by the last stage (the window before was not accepted whole)
    )

    def add(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.windows += 1
            self.drafted += drafted
            self.accepted += accepted

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_window(self) -> float | None:
        """Tokens a window gave: the accepted drafts and the token drawn after them."""
        return (self.accepted + self.windows) / self.windows if self.windows else None


def speculated(counts: Iterable[Any]) -> SpeculationStats | None:
    """The sum of stages' reported windows, drafts, accepted drafts, follow-on and stale windows
    (``Stats``); None when none drafted."""
    total = SpeculationStats()
    for c in counts:
        total.windows, total.drafted, total.accepted = (
            total.windows + c.windows,
            total.drafted + c.drafted,
            total.accepted + c.accepted,
        )
        total.follows, total.stale = total.follows + c.follows, total.stale + c.stale_windows
    return total if total.windows else None


def draws_while_accepted(
    rows: torch.Tensor,
    drafts: Sequence[int],
    generated: Sequence[int],
    draw: Callable[[torch.Tensor, list[int]], TokenEvent | None],
) -> None:
    """A window's draws, wherever it is verified (one process's executor, a pipeline's last
    stage): ``draw(logits, generated so far)`` after each row in turn, while its token is the
    draft in the next row (``rows``: [rows, vocab], or one row's [vocab]); it ends after a failed draw (None), a finishing one, or the first
    token that is not the next draft (the model's own draw there). A row without a window is a
    window of no drafts: one draw."""
    generated = list(generated)
    for index, logits in enumerate(rows if rows.dim() == 2 else rows.unsqueeze(0)):
        event = draw(logits, generated)
        if (
            event is None
            or event.finish_reason is not None
            or index >= len(drafts)
            or event.token != drafts[index]
        ):
            return
        generated.append(event.token)
