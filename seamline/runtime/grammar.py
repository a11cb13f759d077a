"""Constrained decoding: a request's grammar (llguidance's, compiled from a JSON schema or a
tool call's shape by the API) decides which tokens a draw may pick.

The sampling site (the local scheduler, a mesh's last stage, a lockstep group's leader) keeps
a matcher per sequence and feeds it the sequence's output so far before each draw: the tokens
are the truth, so a replayed, preempted or restarted sequence rebuilds its state from them.
When the grammar is complete the request's stop tokens are allowed, and once it can take no
more, only they are: a constrained answer ends with finish_reason "stop".
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

from seamline.errors import RequestError
from seamline.params import SamplingParams

MAX_MATCHERS = 4096  # sequences that never said goodbye are forgotten beyond this many


NO_ANSWER = "no text matches it (its $refs go round in a cycle, or it allows nothing)"


def compile_check(grammar: str, tokenizer: LLTokenizer | None = None) -> str:
    """ "" when llguidance compiles ``grammar`` and, given the tokenizer, some text can match
    it; else why not. A grammar that matches nothing (a schema whose $refs only point at each
    other) would otherwise answer "" with finish_reason "stop"."""
    try:
        error = LLMatcher.validate_grammar(grammar, tokenizer)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    if error or tokenizer is None:
        return error
    start = LLMatcher(tokenizer, grammar, log_level=0)
    start.compute_bitmask()  # what the first draw may take: an empty language shows only here
    return NO_ANSWER if start.is_error() and not start.is_accepting() else ""


def grammar_mask(
    masks: TokenMasks | None,
    key: Hashable,
    params: SamplingParams,
    output: Sequence[int],
    vocab: int,
) -> torch.Tensor | None:
    """What a sampling site asks before a draw: the tokens its grammar allows (None: no
    grammar); a RequestError where this site holds no tokenizer to match one."""
    if not params.grammar:
        return None
    if masks is None:
        raise RequestError("this process cannot apply a grammar: it holds no tokenizer")
    return masks.allowed(key, params, output, vocab)


class _Matcher:
    def __init__(self, tokenizer: LLTokenizer, grammar: str) -> None:
        self.grammar = grammar
        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        self.fed: list[int] = []  # the output consumed so far


class TokenMasks:
    """The matchers of the sequences drawing under a grammar, over one tokenizer.
    ``tokenizer_json``: the tokenizer (``tokenizers``' JSON), read on the first grammar."""

    def __init__(self, tokenizer_json: Callable[[], str]) -> None:
        self._tokenizer_json = tokenizer_json
        self._tokenizers: dict[int, LLTokenizer] = {}  # by vocabulary size (the logits')
        self._matchers: dict[Hashable, _Matcher] = {}
        self._lock = threading.Lock()

    def allowed(
        self, key: Hashable, params: SamplingParams, output: Sequence[int], vocab: int
    ) -> torch.Tensor | None:
        """The tokens sequence ``key`` may draw next, as a bool mask [vocab]; None without a grammar."""
        if not params.grammar:
            return None
        state = self._state(key, params.grammar, output, vocab)
        matcher = state.matcher
        bits = np.unpackbits(
            np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
        )
        mask = torch.from_numpy(bits[:vocab].astype(bool))
        if mask.shape[0] < vocab:
            mask = torch.cat((mask, torch.zeros(vocab - mask.shape[0], dtype=torch.bool)))
        mask[self._tokenizers[vocab].eos_token] = False  # the request's own stop tokens end it
        if matcher.is_stopped():
            mask[:] = False
        if matcher.is_accepting() or matcher.is_stopped():
            mask[[t for t in params.stop_token_ids if 0 <= t < vocab]] = True
        if not bool(mask.any()):
            raise RequestError(
                "the grammar allows no token here, and the request has no stop token"
            )
        return mask

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._matchers.pop(key, None)

    def _state(self, key: Hashable, grammar: str, output: Sequence[int], vocab: int) -> _Matcher:
        with self._lock:
            state = self._matchers.get(key)
            if (
                state is None
                or state.grammar != grammar
                or state.fed != list(output[: len(state.fed)])
            ):
                state = _Matcher(
                    self._tokenizer(vocab), grammar
                )  # new, or its history changed: start over
                self._matchers[key] = state
                while len(self._matchers) > MAX_MATCHERS:
                    del self._matchers[next(iter(self._matchers))]
        fresh = list(output[len(state.fed) :])
        if fresh and not state.matcher.consume_tokens(fresh):
            raise RequestError(f"the output left its grammar: {state.matcher.get_error()}")
        state.fed += fresh
        if state.matcher.is_error():
            raise RequestError(f"the grammar failed: {state.matcher.get_error()}")
        return state

    def _tokenizer(self, vocab: int) -> LLTokenizer:
        if vocab not in self._tokenizers:
            try:
                text = self._tokenizer_json()
            except OSError as exc:
                raise RequestError(
                    f"a grammar needs the tokenizer, which cannot be read here: {exc}"
                ) from None
            self._tokenizers[vocab] = LLTokenizer(text, n_vocab=vocab)
        return self._tokenizers[vocab]


def package_masks(package_dir: Path | None) -> TokenMasks | None:
    """The matchers over a packaged model's tokenizer (None: no package, or no tokenizer in it)."""
    tokenizer = package_dir / "tokenizer.json" if package_dir else None
    if tokenizer is None or not tokenizer.is_file():
        return None
    return TokenMasks(tokenizer.read_text)
