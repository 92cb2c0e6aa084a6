"""The scripted policy server: a deterministic, seeded OpenAI-compatible chat-completions API.

Owns the routes ``GET /v1/models`` and ``POST /v1/chat/completions`` (plain JSON, or SSE when
``stream`` is true: a role chunk, content or tool-call delta chunks, a chunk carrying the
finish reason, a usage chunk when ``stream_options.include_usage`` asks for it, then
``data: [DONE]``), the simulated latency (``latency_ms`` per call) and the token accounting
(prompt tokens estimated at four characters a token, ``tokens_per_call`` completion tokens).
Any model name is accepted and echoed back.

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
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import Field, ValidationError

from rollpoint.http.app import create_app
from rollpoint.policy.openai_wire import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    FinishReason,
    FunctionCall,
    FunctionDelta,
    ModelCard,
    ModelList,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from rollpoint.policy.playbook import Decision, FinalDecision, Playbook, ToolCallDecision
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
    tool_turns: Annotated[int, Field(ge=0, le=1024)] = 3
    """Environments without a built-in playbook: tool-calling turns before the final answer."""


def estimate_prompt_tokens(request: ChatCompletionRequest) -> int:
    chars = 0
    for message in request.messages:
        chars += len(message.text)
        for call in message.tool_calls or ():
            chars += len(call.function.name) + len(call.function.arguments)
    return chars // _CHARS_PER_TOKEN + _TOKENS_PER_MESSAGE * len(request.messages)


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


class _Reply:
    """One call's identity and accounting, shared by the plain and the streamed rendering."""

    def __init__(self, settings: PolicySettings, request: ChatCompletionRequest) -> None:
        self.id = "chatcmpl-" + os.urandom(12).hex()
        self.created = int(time.time())
        self.model = request.model or settings.model
        prompt_tokens = estimate_prompt_tokens(request)
        self.usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=settings.tokens_per_call,
            total_tokens=prompt_tokens + settings.tokens_per_call,
        )

    def completion(self, decision: Decision) -> bytes:
        body = ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[Choice(message=_message(decision), finish_reason=_finish_reason(decision))],
            usage=self.usage,
        )
        return body.model_dump_json().encode()

    def stream(self, decision: Decision, *, include_usage: bool) -> list[bytes]:
        choices = [[ChunkChoice(delta=d)] for d in _deltas(decision)]
        choices.append([ChunkChoice(delta=Delta(), finish_reason=_finish_reason(decision))])
        chunks = [self._chunk(c) for c in choices]
        if include_usage:
            chunks.append(self._chunk([], usage=self.usage))
        return [*chunks, _SSE_DONE]

    def _chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        chunk = ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )
        return b"data: " + chunk.model_dump_json().encode() + b"\n\n"


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

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        collector.start()
        try:
            yield
        finally:
            await collector.aclose()

    app = create_app("scripted-policy", lifespan=lifespan)
    playbook = Playbook(
        seed=settings.seed, error_rate=settings.error_rate, tool_turns=settings.tool_turns
    )
    delay_s = settings.latency_ms / 1000
    models = ModelList(data=[ModelCard(id=settings.model, created=int(time.time()))])
    models_body = models.model_dump_json().encode()

    @app.get("/v1/models")
    async def list_models() -> Response:
        return Response(models_body, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        nonlocal in_flight
        chat = await _read_request(request)
        decision = playbook.decide(chat)
        reply = _Reply(settings, chat)
        if delay_s > 0:
            in_flight += 1
            try:
                await asyncio.sleep(delay_s)
            finally:
                in_flight -= 1
        if not chat.stream:
            return Response(reply.completion(decision), media_type="application/json")
        include_usage = chat.stream_options is not None and chat.stream_options.include_usage
        chunks = reply.stream(decision, include_usage=include_usage)
        return StreamingResponse(_sse(chunks), media_type="text/event-stream")

    return app
