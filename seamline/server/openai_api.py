"""The OpenAI-compatible HTTP API over a Backend: models, chat and text completions, health.

Decisions (see also openai_schema.py for field policy):
- ``model`` must be the backend's ``model_name`` or the alias ``"default"``; anything else
  is 404 ``model_not_found``. Responses always carry the real name.
- Omitted ``temperature`` is 1.0, as in OpenAI's API (send 0 for greedy); omitted
  ``max_tokens`` means "up to the end of the context"; ``prompt + max_tokens`` beyond the
  context is 400 ``context_length_exceeded``.
- Order of checks: body (400) -> model (404) -> readiness (503) -> prompt (400).
- The first token is awaited before a response is committed, so a request the backend
  refuses is a proper 400/503 even when streaming; later failures of a stream arrive as an
  SSE ``data: {"error": ...}`` event, after which the stream ends (no ``[DONE]``).
- A client that goes away closes the backend's token iterator, which cancels the request:
  the route watches for it while it awaits the first token (or, not streaming, the whole
  answer), so a request no one waits for is never prefilled, nor replayed by a healing mesh.
- Bodies are parsed by the routes (server/bodies.py): a large one, and its prompt, off the
  event loop, one at a time; a prompt surely too long is refused before it is tokenised whole.
- A request's choices are started, streamed and collected, and a failure made the client's
  error, in choice_streams.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from seamline.chat_template import TemplateError
from seamline.errors import RequestError
from seamline.params import SamplingParams
from seamline.runtime.backend import Backend
from seamline.server.api_options import ApiLimits
from seamline.server.bodies import LargeBodies, encode_within
from seamline.server.choice_streams import (
    SSE_HEADERS,
    EventStream,
    backend_error,
    choice_params,
    close_all,
    collect_choices,
    sse_events,
    start_all,
    usage_of,
)
from seamline.server.console import console_routes
from seamline.server.generation import Generation
from seamline.server.grammars import GrammarCheck
from seamline.server.guard import Guard
from seamline.server.harmony import HarmonySplitter, uses_harmony
from seamline.server.leaving import unless_gone
from seamline.server.metrics import Metrics, RequestMeter
from seamline.server.openai_schema import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    bad_request,
    error_body,
    validation_error,
)
from seamline.server.reasoning import Splitter, ThinkSplitter, uses_think_blocks
from seamline.server.replies import Choice, Reply
from seamline.server.tools import ToolPlan, ToolStream, plan_tools

log = logging.getLogger("seamline.server")

MODEL_ALIAS = "default"  # accepted in place of the served model's name
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; 0 is greedy


def create_app(
    backend: Backend,
    extra_routes: Callable[[FastAPI], None] | None = None,
    limits: ApiLimits = ApiLimits(),
    metrics: Metrics | None = None,
) -> FastAPI:
    """The FastAPI app serving ``backend``; ``extra_routes(app)`` may add more (e.g. a console).
    ``limits``: API keys, body size, prompt tokens and requests in flight per key; ``metrics``:
    what ``/metrics`` exposes (by default the API's own, and the backend's ``report``)."""
    # FastAPI's strict content type stays on: a body is JSON only with Content-Type: application/json,
    # so a web page cannot make a visitor's browser spend this server's compute (no CORS preflight).
    app = FastAPI(title="seamline", summary="One model, one OpenAI-compatible endpoint.")
    _install_error_handlers(app)
    app.add_middleware(Guard, limits=limits)
    metrics = metrics or Metrics(getattr(backend, "report", None))
    routes = _Routes(backend, metrics, limits.max_prompt_tokens)
    app.state.metrics = metrics
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    console_routes(app)
    app.add_api_route("/v1/models", routes.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.get_model, methods=["GET"])
    app.add_api_route(
        "/v1/chat/completions", routes.chat, methods=["POST"], response_model=None
    )  # body: ChatRequest
    app.add_api_route(
        "/v1/completions", routes.completions, methods=["POST"], response_model=None
    )  # CompletionRequest
    if extra_routes is not None:
        extra_routes(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    async def openai_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def invalid(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        err = validation_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        body = error_body(message, "invalid_request_error", None, _code_for(exc.status_code))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def crashed(_: Request, exc: Exception) -> Response:
        err = backend_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, crashed)


def _code_for(status: int) -> str:
    return {404: "not_found", 405: "method_not_allowed"}.get(status, f"http_{status}")


@dataclass(frozen=True)
class _Shape:
    tools: ToolPlan
    grammar: str  # "" when the answer is free


class _Routes:
    def __init__(
        self, backend: Backend, metrics: Metrics, max_prompt_tokens: int | None = None
    ) -> None:
        self.backend = backend
        self.grammars = GrammarCheck(backend.codec)  # builds its tokenizer on the first grammar
        self.telemetry = metrics
        self.max_prompt_tokens = max_prompt_tokens
        self.large = LargeBodies()
        self.created = int(time.time())

    async def health(self) -> Response:
        ready, reason = self._readiness()
        if ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)

    async def metrics(self) -> Response:
        body, content_type = await anyio.to_thread.run_sync(
            self.telemetry.render
        )  # the backend may ask its nodes
        return Response(body, media_type=content_type)

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    async def get_model(self, model_id: str) -> dict[str, Any]:
        self._check_model(model_id)
        return self._model_card()

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        raw = await request.body()
        async with self.large.expanding(raw):
            body = await self.large.parse(raw, request.headers.get("content-type"), ChatRequest)
            self._check_model(body.model)
            self._check_ready()
            shape = await anyio.to_thread.run_sync(
                self._shape, body
            )  # compiling a grammar takes a while
            text, prompt = await anyio.to_thread.run_sync(
                self._render_chat, body, shape.tools.tools
            )  # a large prompt must not stall the loop
            grammar = await anyio.to_thread.run_sync(self._grammar_after, shape, text)
        params = replace(self._params(body, prompt, "messages"), grammar=grammar)
        return await self._respond(
            request,
            Reply.new(True, self.backend.model_name),
            prompt,
            params,
            bool(body.stream),
            body.include_usage,
            "",
            body.n or 1,
            self._reasoning(text),
            shape.tools,
        )

    def _reasoning(self, prompt_text: str) -> Callable[[], Splitter] | None:
        """How an answer's reasoning is told from its content, where the template says: think
        blocks, or harmony's analysis channel (``server/harmony.py``)."""
        template = self.backend.codec.chat_template
        if uses_harmony(template):
            return HarmonySplitter
        return (lambda: ThinkSplitter(prompt_text)) if uses_think_blocks(template) else None

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        raw = await request.body()
        async with self.large.expanding(raw):
            body = await self.large.parse(
                raw, request.headers.get("content-type"), CompletionRequest
            )
            self._check_model(body.model)
            self._check_ready()
            prompt = await anyio.to_thread.run_sync(self._encode_prompt, body.prompt)
        params = self._params(body, prompt, "prompt")
        echo = ""
        if body.echo:
            echo = (
                body.prompt if isinstance(body.prompt, str) else self.backend.codec.decode(prompt)
            )
        return await self._respond(
            request,
            Reply.new(False, self.backend.model_name),
            prompt,
            params,
            bool(body.stream),
            body.include_usage,
            echo,
            body.n or 1,
        )

    async def _respond(
        self,
        request: Request,
        reply: Reply,
        prompt: list[int],
        params: SamplingParams,
        stream: bool,
        include_usage: bool,
        echo: str,
        n: int = 1,
        reasoning: Callable[[], Splitter] | None = None,
        tools: ToolPlan | None = None,
    ) -> Response:
        """``reasoning``: makes each choice's splitter of reasoning from content, where the chat
        template has reasoning; ``tools``: the request's, when its answer is parsed for tool calls."""
        self.telemetry.prompt_tokens.inc(len(prompt))
        gens = [
            Generation(self.backend, prompt, p, RequestMeter(self.telemetry))
            for p in choice_params(params, n)
        ]
        for gen in gens:
            gen.text_offset = len(echo)
            if reasoning is not None:
                gen.split_reasoning(reasoning())
            if tools is not None and tools.fmt is not None:
                gen.parse_tools(ToolStream(tools.fmt, tools.schemas), tools.named)
        try:
            started, _ = await unless_gone(request, start_all(gens))
        except Exception as exc:
            for gen in gens:
                gen.meter.end("error")
            await close_all(gens)
            raise backend_error(exc) from exc
        if (
            started and stream
        ):  # from here the stream notices the client leaving (Starlette listens)
            events = sse_events(reply, gens, include_usage, echo)
            return EventStream(events, media_type="text/event-stream", headers=SSE_HEADERS)
        choices: list[Choice] | None = None
        try:
            if started:
                _, choices = await unless_gone(request, collect_choices(gens, reply.chat, echo))
        except Exception as exc:
            raise backend_error(exc) from exc
        finally:
            await close_all(gens)
        if choices is None:
            log.info("client went away; request %s cancelled", reply.id)
            return Response(status_code=499)
        return JSONResponse(reply.full(choices, usage_of(gens)))

    def _model_card(self) -> dict[str, Any]:
        name = self.backend.model_name
        return {"id": name, "object": "model", "created": self.created, "owned_by": "seamline"}

    def _check_model(self, name: str) -> None:
        if name not in (self.backend.model_name, MODEL_ALIAS):
            message = (
                f"the model '{name}' does not exist; this server serves "
                f"'{self.backend.model_name}' (or use '{MODEL_ALIAS}')"
            )
            raise OpenAIError(404, message, "invalid_request_error", "model", "model_not_found")

    def _readiness(self, admitting: bool = False) -> tuple[bool, str]:
        """Whether the backend serves (for /health), or with ``admitting`` whether it takes a new
        request now (a healing mesh takes it, and it waits for the route)."""
        try:
            state = self.backend.readiness()
        except Exception as exc:  # noqa: BLE001 - a failing probe means "not ready", with its reason
            return False, f"readiness check failed: {exc}"
        return state.ready or (admitting and state.waits), state.reason or (
            "" if state.ready else "the backend is not ready"
        )

    def _check_ready(self) -> None:
        ready, reason = self._readiness(admitting=True)
        if not ready:
            message = f"the model '{self.backend.model_name}' is not ready to serve: {reason}"
            raise OpenAIError(503, message, "service_unavailable", None, "model_not_ready")

    def _shape(self, body: ChatRequest) -> _Shape:
        """The request's tools and the grammar its answer must match (checked: 400s here)."""
        tools = plan_tools(body, self.backend.codec.chat_template, self.grammars)
        grammar = self.grammars.response_format(body.response_format)
        if grammar and tools.grammar:
            raise bad_request(
                "a required tool call and a JSON response_format cannot both shape the answer",
                "response_format",
                "invalid_value",
            )
        if (grammar or tools.grammar) and body.ignore_eos:
            raise bad_request(
                "ignore_eos cannot be sent with a grammar: the answer ends with the end of its grammar",
                "ignore_eos",
                "invalid_value",
            )
        return _Shape(tools, grammar or tools.grammar)

    def _grammar_after(self, shape: _Shape, prompt_text: str) -> str:
        """The answer's grammar: a required call's follows a think block its prompt opened."""
        return (
            shape.tools.grammar_after(prompt_text, self.grammars)
            if shape.tools.grammar
            else shape.grammar
        )

    def _render_chat(self, body: ChatRequest, tools: list[dict[str, Any]]) -> tuple[str, list[int]]:
        messages = [m.as_template_dict() for m in body.messages]
        try:
            text = self.backend.codec.render_chat(
                messages, tools, body.documents, body.template_variables()
            )
        except (RequestError, TemplateError) as exc:
            raise bad_request(str(exc), "messages", "invalid_messages") from exc
        return text, self._encode(text, "messages", chat=True)

    def _encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._encode(prompt, "prompt")
        self._check_ids(prompt, "prompt", "token id")
        return list(prompt)

    def _encode(self, text: str, field: str, chat: bool = False) -> list[int]:
        """The prompt's tokens, with BOS and EOS where the model adds them (``chat``: a rendered
        chat's); a 400 as soon as it surely has more than the server takes."""
        codec = self.backend.codec
        ends = codec.ends_for(chat)
        most = self.backend.context_length - 1
        if self.max_prompt_tokens is not None:
            most = min(most, self.max_prompt_tokens)
        added = len(ends.prefix) + len(ends.suffix)
        ids = encode_within(codec, codec.strip_chat_ends(text) if chat else text, most - added)
        if ids is None:
            self._check_length(most, field, more=True)  # raises: more than ``most`` never fits
        return [*ends.prefix, *(ids or []), *ends.suffix]

    def _check_length(self, count: int, field: str, more: bool = False) -> None:
        """A 400 when a prompt of ``count`` tokens (``more``: more than that) does not fit."""
        context, cap = self.backend.context_length, self.max_prompt_tokens
        has = f"more than {count}" if more else str(count)
        if count >= context - (1 if more else 0):
            message = (
                f"the prompt has {has} tokens; the model's context is {context} "
                f"tokens, so a prompt may have at most {context - 1}"
            )
            raise bad_request(message, field, "context_length_exceeded")
        if cap is not None and count >= cap + (0 if more else 1):
            message = f"the prompt has {has} tokens; this server takes at most {cap} (--max-prompt-tokens)"
            raise bad_request(message, field, "prompt_too_long")

    def _bias(self, body: ChatRequest | CompletionRequest) -> tuple[tuple[int, float], ...]:
        pairs = body.bias_pairs()
        self._check_ids([t for t, _ in pairs], "logit_bias", "logit_bias token")
        return pairs

    def _check_ids(self, ids: list[int], field: str, what: str) -> None:
        vocab = self.backend.codec.tokenizer.get_vocab_size(with_added_tokens=True)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(
                f"{what} {bad} is outside the vocabulary [0, {vocab})", field, "invalid_value"
            )

    def _params(
        self, body: ChatRequest | CompletionRequest, prompt: list[int], field: str
    ) -> SamplingParams:
        """Sampling parameters after the prompt-length checks against the context."""
        context = self.backend.context_length
        if not prompt:
            raise bad_request("the prompt is empty", field, "invalid_value")
        self._check_length(len(prompt), field)
        room = context - len(prompt)
        limit = body.limit
        if limit is not None and limit > room:
            name = (
                "max_completion_tokens"
                if getattr(body, "max_completion_tokens", None)
                else "max_tokens"
            )
            message = (
                f"{name} is {limit}, but the prompt ({len(prompt)} tokens) leaves "
                f"{room} of the model's {context}-token context"
            )
            raise bad_request(message, name, "context_length_exceeded")
        params = SamplingParams(
            temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
            top_k=max(0, body.top_k or 0),
            top_p=1.0 if body.top_p is None else body.top_p,
            min_p=body.min_p or 0.0,
            seed=body.seed,
            max_tokens=room if limit is None else limit,
            stop_token_ids=() if body.ignore_eos else tuple(self.backend.codec.stop_ids),
            stop_strings=tuple(s for s in body.stop or () if s),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=self._bias(body),
            logprobs=body.top,
        )
        try:
            params.validate()
        except RequestError as exc:
            raise bad_request(str(exc), None, "invalid_value") from exc
        return params
