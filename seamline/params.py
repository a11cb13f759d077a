"""What a request asks of generation: how to draw tokens and when to stop. It crosses the
wire as it is (``net.messages.Open``), so it sits below both the runtime and the wire."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ConfigDict

from seamline.errors import RequestError

MAX_TOP_LOGPROBS = 20  # as OpenAI's API allows
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API allows
MAX_STOP = 4  # stop strings, as OpenAI's API allows
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_STOP_TOKEN_IDS = 64  # the model's end-of-sequence ids (set by the server, never by a caller)
MAX_GRAMMAR_BYTES = (
    96 << 10
)  # UTF-8: a 64 KiB JSON schema's grammar (the API's bound) with room to spare


@dataclass(frozen=True)
class SamplingParams:
    """How a sequence draws and when it stops; it crosses the wire as it is (``Open``).

    Its size is bounded (``validate``), so an ``Open`` always fits a node's 1 MiB control
    frame: as JSON, even with every character escaped (``\\u00XX``, 6 bytes), the grammar is
    at most 6 x 96 KiB, the stop strings 6 x 4 x 1024, the logit bias 300 pairs of ~40 bytes
    and the stop ids 64 of ~12 bytes: about 620 KiB at worst, with the scalars.
    """

    __pydantic_config__ = ConfigDict(extra="forbid")  # validated where it arrives from a peer

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    presence_penalty: float = 0.0  # minus this from every token already generated
    frequency_penalty: float = 0.0  # minus this times how often the token was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = (
        None  # None: none; k: the drawn token's log-probability and the k likeliest
    )
    grammar: str = ""  # llguidance's grammar the output must match (runtime/grammar.py); "": free

    def validate(self) -> None:
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not -100 <= bias <= 100 for _, bias in self.logit_bias):
            raise RequestError("logit_bias values must be in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}"
            )
        self._validate_sizes()

    def _validate_sizes(self) -> None:
        """The bounds that keep the parameters' size known (see the class's doc)."""
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(
                f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"
            )
        if len(self.stop_strings) > MAX_STOP or any(
            len(s) > MAX_STOP_CHARS for s in self.stop_strings
        ):
            raise RequestError(
                f"at most {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters each"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(
                f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}"
            )
        if len(self.grammar) > MAX_GRAMMAR_BYTES or len(self.grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise RequestError(
                f"a grammar may be at most {MAX_GRAMMAR_BYTES} bytes, got {len(self.grammar.encode())}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether the tokens generated so far change the logits (presence, frequency)."""
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def argmax_only(self) -> bool:
        """Whether the raw logits' argmax is all a draw needs (greedy, nothing shifts or masks
        the logits, no log-probabilities asked): a lockstep group then exchanges (max, argmax)."""
        return (
            self.greedy
            and not self.penalised
            and not self.logit_bias
            and self.logprobs is None
            and not self.grammar
        )
