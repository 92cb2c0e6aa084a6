"""The scripted policy server: a deterministic, seeded OpenAI-compatible chat-completions API.

Owns the routes ``GET /v1/models``, ``GET /v1/models/{id}`` and ``POST /v1/chat/completions`` (plain JSON, or SSE when
``stream`` is true: a role chunk, content or tool-call delta chunks, a chunk carrying the
finish reason, a usage chunk when ``stream_options.include_usage`` asks for it, then
``data: [DONE]``), the simulated latency (``latency_ms`` per call) and the token accounting
(prompt tokens estimated at four characters a token, ``tokens_per_call`` completion tokens).
It serves one model, ``model``: a request naming another is refused with 404
``model_not_found``; one naming none is answered as ``model``. ``n`` choices are returned,
choice ``i`` decided under its own seed. Errors take OpenAI's shape (:mod:`rollpoint.http.app`).
With ``$ROLLPOINT_DATA_TOKEN`` set (the runtime sets it as for every server), every route but
``/healthz`` needs that token, like every other data route; the model servers send it
(``upstream_data_token``).

Token data, when a request asks (``return_token_ids``, ``logprobs``, ``top_logprobs``,
``return_tokens_as_token_ids``): ids and logprobs from the stand-in tokenizer
(:mod:`rollpoint.policy.stand_in_tokenizer`), in vLLM's shape or SGLang's
(``PolicySettings.shape``), streamed and not; ``usage`` then counts those tokens. With
``call_log`` set, every reply's token data is appended to that JSONL file before the reply
leaves: the engine's own account, which tests compare rollpoint's records against.

It runs full garbage collections only while no call is in flight
(:class:`~rollpoint.store.collector_schedule.ServerCollector` with ``idle``). Holding 10k calls in a
benchmark, CPython's own took 1.1-2.8 s every few seconds and freed nothing: the stand-in
engine stalled every call it held. (They were also suspected of lengthening the next
snapshot pause through the burst of replies after each; with them gone the 10k point
still had pauses of 125-462 ms, so that was not the only cause. See docs/PERFORMANCE.md.)

Does not own: what to answer (:mod:`rollpoint.policy.playbook`) or the payload shapes
(:mod:`rollpoint.policy.openai_wire`). Starting the process is the runtime's job.

This is the hot path of every benchmark: the body is parsed once by pydantic's JSON parser
(which also refuses lone surrogates, so nothing unencodable reaches the response), and the
response is rendered straight from our models, with no second validation pass.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, BinaryIO, Literal

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import Field, ValidationError

from rollpoint.http.app import create_app
from rollpoint.http.auth import data_token
from rollpoint.policy import stand_in_tokenizer as stand_in
from rollpoint.policy.openai_wire import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    FinishReason,
    FunctionCall,
    FunctionDelta,
    ModelCard,
    ModelList,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from rollpoint.policy.playbook import Decision, FinalDecision, Playbook, ToolCallDecision
from rollpoint.protocol.errors import ModelNotFoundError
from rollpoint.protocol.model_base import StrictModel
from rollpoint.store.collector_schedule import CollectorSchedule, ServerCollector

_CHARS_PER_TOKEN = 4
_TOKENS_PER_MESSAGE = 4
"""Chat-template overhead per message, as real tokenizers add role markers."""
_STREAM_PIECE_CHARS = 16
"""Stream deltas carry this many characters each, so clients exercise their accumulation."""
_SSE_DONE = b"data: [DONE]\n\n"


class PolicySettings(StrictModel):
    seed: int = 0
    latency_ms: Annotated[float, Field(ge=0)] = 0.0
    """Time each call takes, in milliseconds; 0 answers without sleeping at all."""
    error_rate: Annotated[float, Field(ge=0, le=1)] = 0.05
    """Probability that a tool-calling turn emits a wrong call (a wrong number for math)."""
    tokens_per_call: Annotated[int, Field(ge=1)] = 48
    """Completion tokens reported in ``usage`` for every call."""
    model: str = "scripted"
    """The id listed by ``GET /v1/models``, and echoed when a request names no model."""
    call_log: str | None = None
    """A JSONL file to append every reply's token data to (the engine's own log)."""
    shape: Literal["vllm", "sglang"] = "vllm"
    """Where token ids go: vLLM's (top-level ``prompt_token_ids``, ids on every stream
    chunk) or SGLang's OpenAI-compatible server (both on the choice; none when streamed)."""
    tool_turns: Annotated[int, Field(ge=0, le=1024)] = 3
    """Environments without a built-in playbook: tool-calling turns before the final answer."""


def estimate_prompt_tokens(request: ChatCompletionRequest) -> int:
    chars = 0
    for message in request.messages:
        chars += len(message.text)
        for call in message.tool_calls or ():
            chars += len(call.function.name) + len(call.function.arguments)
    return chars // _CHARS_PER_TOKEN + _TOKENS_PER_MESSAGE * len(request.messages)


def _reseeded(request: ChatCompletionRequest, index: int) -> ChatCompletionRequest:
    return request.model_copy(update={"seed": choice_seed(request.seed, index)})


def _finish_reason(decision: Decision) -> FinishReason:
    return "stop" if isinstance(decision, FinalDecision) else "tool_calls"


def _message(decision: Decision) -> AssistantMessage:
    if isinstance(decision, FinalDecision):
        return AssistantMessage(content=decision.text)
    call = ToolCall(
        id=decision.call_id,
        function=FunctionCall(name=decision.name, arguments=decision.arguments),
    )
    return AssistantMessage(content=None, tool_calls=[call])


def _pieces(text: str) -> list[str]:
    return [text[i : i + _STREAM_PIECE_CHARS] for i in range(0, len(text), _STREAM_PIECE_CHARS)]


def _deltas(decision: Decision) -> list[Delta]:
    if isinstance(decision, FinalDecision):
        return [
            Delta(role="assistant", content=""),
            *(Delta(content=p) for p in _pieces(decision.text)),
        ]
    return _tool_call_deltas(decision)


def _tool_call_deltas(decision: ToolCallDecision) -> list[Delta]:
    head = ToolCallDelta(
        index=0,
        id=decision.call_id,
        type="function",
        function=FunctionDelta(name=decision.name, arguments=""),
    )
    tail = (
        Delta(tool_calls=[ToolCallDelta(index=0, function=FunctionDelta(arguments=p))])
        for p in _pieces(decision.arguments)
    )
    return [Delta(role="assistant"), Delta(tool_calls=[head]), *tail]


class _Tokens:
    """One choice's stand-in token data: ids, their text, and their logprobs."""

    def __init__(self, decision: Decision, seed: int, index: int) -> None:
        message = _message(decision)
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
        self.tokens = stand_in.message_body(message.content or "", calls)
        self.ids = [t.id for t in self.tokens]
        self.logprobs = [
            stand_in.logprob(seed, index, pos, t.id) for pos, t in enumerate(self.tokens)
        ]

    def content(self, start: int, stop: int, *, as_ids: bool, top: int) -> ChoiceLogprobs:
        entries = []
        for token, lp in zip(self.tokens[start:stop], self.logprobs[start:stop], strict=True):
            tops = [
                TopLogprob(token=_token_text(t, as_ids), logprob=alt, bytes=_bytes(t))
                for t, alt in stand_in.alternatives(token, lp, top)
            ]
            entries.append(
                TokenLogprob(
                    token=_token_text(token, as_ids),
                    logprob=lp,
                    bytes=_bytes(token),
                    top_logprobs=tops,
                )
            )
        return ChoiceLogprobs(content=entries)


def _token_text(token: stand_in.Token, as_ids: bool) -> str:
    return f"token_id:{token.id}" if as_ids else token.text


def _bytes(token: stand_in.Token) -> list[int]:
    return list(token.text.encode("utf-8", "surrogatepass"))


def _prompt_ids(request: ChatCompletionRequest) -> list[int]:
    return stand_in.prompt_ids(
        (
            m.role,
            m.text,
            [(c.function.name, c.function.arguments) for c in m.tool_calls or ()],
        )
        for m in request.messages
    )


def choice_seed(request_seed: int | None, index: int) -> int | None:
    """The seed choice ``index`` is decided under: choice 0 under the request's own."""
    if index == 0:
        return request_seed
    return ((request_seed or 0) * 1_000_003 + index) & 0x7FFFFFFF


class _Reply:
    """One call's identity and accounting, shared by the plain and the streamed rendering.

    With ``return_token_ids`` or ``logprobs`` asked, every choice gets stand-in token data
    (vLLM's shape) and ``usage`` counts those tokens; otherwise usage is the estimate.
    """

    def __init__(
        self, settings: PolicySettings, request: ChatCompletionRequest, decisions: list[Decision]
    ) -> None:
        self.id = "chatcmpl-" + os.urandom(12).hex()
        self.created = int(time.time())
        self.model = request.model or settings.model
        self.decisions = decisions
        self.return_ids = request.return_token_ids
        self.sglang = settings.shape == "sglang"
        self.return_prompt = request.return_prompt_token_ids
        self.logprobs = request.logprobs
        self.as_ids = request.return_tokens_as_token_ids
        self.top = request.top_logprobs
        self.prompt: list[int] | None = None
        self.tokens: list[_Tokens] | None = None
        if self.return_ids or self.logprobs:
            seed = request.seed or 0
            self.prompt = _prompt_ids(request)
            self.tokens = [_Tokens(d, seed, i) for i, d in enumerate(decisions)]
            prompt_tokens = len(self.prompt)
            completion = sum(len(t.ids) for t in self.tokens)
        else:
            prompt_tokens = estimate_prompt_tokens(request)
            completion = settings.tokens_per_call * len(decisions)
        self.usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            total_tokens=prompt_tokens + completion,
        )

    def _choice_tokens(
        self, index: int, start: int, stop: int, *, streamed: bool = False
    ) -> dict[str, Any]:
        if self.tokens is None:
            return {}
        tokens = self.tokens[index]
        out: dict[str, Any] = {}
        if self.return_ids and not (streamed and self.sglang):
            out["token_ids"] = tokens.ids[start:stop]
            if self.sglang and self.return_prompt:
                out["prompt_token_ids"] = self.prompt
        if self.logprobs:
            out["logprobs"] = tokens.content(start, stop, as_ids=self.as_ids, top=self.top)
        return out

    def completion(self) -> bytes:
        choices = [
            Choice(
                index=i,
                message=_message(d),
                finish_reason=_finish_reason(d),
                **self._choice_tokens(i, 0, len(self.tokens[i].ids) if self.tokens else 0),
            )
            for i, d in enumerate(self.decisions)
        ]
        body = ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage,
            prompt_token_ids=self.prompt if self.return_ids and not self.sglang else None,
        )
        return body.model_dump_json().encode()

    def stream(self, *, include_usage: bool) -> list[bytes]:
        chunks: list[bytes] = []
        for i, decision in enumerate(self.decisions):
            deltas = _deltas(decision)
            # The ids ride on the content deltas after the role delta, spread evenly; the
            # end token rides on the chunk that carries the finish reason.
            n = len(self.tokens[i].ids) if self.tokens else 0
            spans = _spans(max(n - 1, 0), len(deltas) - 1)
            for j, delta in enumerate(deltas):
                start, stop = (0, 0) if j == 0 else spans[j - 1]
                tokens = self._choice_tokens(i, start, stop, streamed=True)
                choice = ChunkChoice(index=i, delta=delta, **tokens)
                first = i == 0 and j == 0
                prompt = self.prompt if first and self.return_ids and not self.sglang else None
                chunks.append(self._chunk([choice], prompt=prompt))
            last = ChunkChoice(
                index=i,
                delta=Delta(),
                finish_reason=_finish_reason(decision),
                **self._choice_tokens(i, max(n - 1, 0), n, streamed=True),
            )
            chunks.append(self._chunk([last]))
        if include_usage:
            chunks.append(self._chunk([], usage=self.usage))
        return [*chunks, _SSE_DONE]

    def _chunk(
        self,
        choices: list[ChunkChoice],
        usage: Usage | None = None,
        prompt: list[int] | None = None,
    ) -> bytes:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt,
        )
        return b"data: " + chunk.model_dump_json().encode() + b"\n\n"

    def log_line(self, request: ChatCompletionRequest) -> bytes:
        """The call log's record of this reply: what was asked (but the conversation) and
        every choice's token data, as the engine's own account of what it sampled."""
        asked = request.model_dump(mode="json", exclude={"messages", "tools"}, exclude_none=True)
        choices = [
            {
                "index": i,
                "finish_reason": _finish_reason(d),
                "token_ids": None if self.tokens is None else self.tokens[i].ids,
                "logprobs": None if self.tokens is None else self.tokens[i].logprobs,
            }
            for i, d in enumerate(self.decisions)
        ]
        line = {
            "id": self.id,
            "created": self.created,
            "request": asked,
            "prompt_token_ids": self.prompt,
            "choices": choices,
        }
        return orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)


def _spans(count: int, parts: int) -> list[tuple[int, int]]:
    """``count`` items cut into ``parts`` consecutive spans, as even as can be."""
    if parts <= 0:
        return []
    bounds = [count * k // parts for k in range(parts + 1)]
    return list(itertools.pairwise(bounds))


async def _sse(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def _read_request(request: Request) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        # create_app turns this into the one-line 422 that names the field.
        raise RequestValidationError(exc.errors(include_url=False)) from None


def create_policy_app(
    settings: PolicySettings, *, schedule: CollectorSchedule | None = None
) -> FastAPI:
    """``schedule``: the collector schedule to attach (default: this process's)."""
    in_flight = 0
    collector = ServerCollector(schedule, idle=lambda: in_flight == 0)

    call_log: BinaryIO | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal call_log
        collector.start()
        if settings.call_log is not None:
            # Unbuffered appends: each reply's line is in the file before the reply leaves,
            # so a run killed at any moment still has the engine's account of every call.
            call_log = open(settings.call_log, "ab", buffering=0)  # noqa: SIM115, ASYNC230
        try:
            yield
        finally:
            if call_log is not None:
                call_log.close()
            await collector.aclose()

    app = create_app("scripted-policy", lifespan=lifespan, data_token=data_token())
    playbook = Playbook(
        seed=settings.seed, error_rate=settings.error_rate, tool_turns=settings.tool_turns
    )
    delay_s = settings.latency_ms / 1000
    models = ModelList(data=[ModelCard(id=settings.model, created=int(time.time()))])
    models_body = models.model_dump_json().encode()

    card_body = models.data[0].model_dump_json().encode()

    def check_model(model: str | None) -> None:
        if model is not None and model != settings.model:
            raise ModelNotFoundError(
                f"the model '{model}' does not exist (this policy serves '{settings.model}')"
            )

    @app.get("/v1/models")
    async def list_models() -> Response:
        return Response(models_body, media_type="application/json")

    # :path: model ids may hold slashes ("org/name").
    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        check_model(model_id)
        return Response(card_body, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        nonlocal in_flight
        chat = await _read_request(request)
        check_model(chat.model)
        decisions = [playbook.decide(chat if i == 0 else _reseeded(chat, i)) for i in range(chat.n)]
        reply = _Reply(settings, chat, decisions)
        if call_log is not None:
            call_log.write(reply.log_line(chat))
        if delay_s > 0:
            in_flight += 1
            try:
                await asyncio.sleep(delay_s)
            finally:
                in_flight -= 1
        if not chat.stream:
            return Response(reply.completion(), media_type="application/json")
        include_usage = chat.stream_options is not None and chat.stream_options.include_usage
        chunks = reply.stream(include_usage=include_usage)
        return StreamingResponse(_sse(chunks), media_type="text/event-stream")

    return app
