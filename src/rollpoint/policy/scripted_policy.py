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

Long generations, for the generation cut: ``token_latency_ms`` makes each completion token
take that long, a stream then sending one token a chunk as it is "decoded";
``reasoning_tokens`` puts stand-in reasoning text before every tool call. A request with
``continue_final_message: true`` whose last message is a partial assistant message this
engine produced continues it (vLLM's rendering: the prompt ids end with the prefix's) and
decodes only the rest, with the positions and so the logprobs of the uninterrupted call:
prefix + continuation is exactly that call's output. The call log then has the
``prefix_token_ids`` it was given beside the ``token_ids`` it decoded. ``accept_prefix:
false`` answers such requests with a 400, as an engine that cannot take a prefix does.

Bad engine data on purpose (``faults``, off by default: :mod:`rollpoint.policy.scripted_faults`):
an oversized reply, a bad token id or logprob in a stream, a streamed tool call without an
id, on the calls each fault names, each one logged to ``fault_log``.

Weight updates (:mod:`rollpoint.policy.scripted_weights`): vLLM's and SGLang's pause and
resume routes and ``/update_weight_version`` (unless ``pause_routes`` is off: an engine
without them), every paced token sampled at a token boundary under the version live then,
and ``weights_log``, the engine's own account of which version sampled each token span.

It runs full garbage collections only while no call is in flight
(:class:`~rollpoint.tuning.collector_schedule.ServerCollector` with ``idle``). Holding 10k calls in a
benchmark, CPython's own took 1.1-2.8 s every few seconds and freed nothing: the stand-in
engine stalled every call it held. (They were also suspected of lengthening the next
snapshot pause through the burst of replies after each; with them gone the 10k point
still had pauses of 125-462 ms, so that was not the only cause. See
docs/log/performance-2026.md, "Re-measured on the code that landed".)

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
import zlib
from collections.abc import AsyncIterator, Callable
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
from rollpoint.policy.engine_check import START_CHECK_PROMPT
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
from rollpoint.policy.playbook import Decision, FinalDecision, Playbook
from rollpoint.policy.scripted_faults import FaultPlan
from rollpoint.policy.scripted_weights import (
    Aborted,
    Generation,
    ScriptedWeights,
    mount_weight_routes,
)
from rollpoint.protocol.engine_faults import EngineFault
from rollpoint.protocol.errors import BadRequestError, ModelNotFoundError
from rollpoint.protocol.model_base import StrictModel
from rollpoint.tuning.collector_schedule import CollectorSchedule, ServerCollector

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
    token_latency_ms: Annotated[float, Field(ge=0)] = 0.0
    """Decode time per completion token (on top of ``latency_ms``): a stream then sends
    each token in its own chunk as it is "sampled", so a generation can be cut mid-way."""
    reasoning_tokens: Annotated[int, Field(ge=0)] = 0
    """Stand-in tokens of reasoning text before every tool call (the assistant message's
    content), as reasoning models think before they act: a long generation to cut."""
    decode_log: str | None = None
    """A JSONL file with one line per paced generation (``token_latency_ms``) as it ends or
    is cut off: ``{"id", "decoded", "max_tokens"}``, the tokens it actually decoded."""
    accept_prefix: bool = True
    """Whether ``continue_final_message`` is honoured; False answers it with a 400, as an
    engine that cannot continue a prefix does."""
    weights_log: str | None = None
    """A JSONL file with one line per generation as it ends: which weights version sampled
    each run of its tokens (:mod:`rollpoint.policy.scripted_weights`)."""
    pause_routes: bool = True
    """Serve the engines' pause, resume and weight-version routes; False: an engine
    without them (they answer 404, and a weight update drains its calls instead)."""
    faults: list[EngineFault] = Field(default_factory=list)
    """Bad engine data on purpose, on the calls each fault names
    (:mod:`rollpoint.policy.scripted_faults`); none by default."""
    fault_log: str | None = None
    """A JSONL file with one line per corruption ``faults`` made, before its reply leaves."""


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


def reasoning_text(call_id: str, tokens: int) -> str:
    """``tokens`` stand-in tokens of "reasoning" (four characters each), a pure function of
    the call id (itself a function of the seeds and the conversation)."""
    return "".join(f"{zlib.crc32(f'{call_id}/{i}'.encode()) % 4096:03x} " for i in range(tokens))


def _message(decision: Decision, reasoning_tokens: int = 0) -> AssistantMessage:
    if isinstance(decision, FinalDecision):
        return AssistantMessage(content=decision.text)
    call = ToolCall(
        id=decision.call_id,
        function=FunctionCall(name=decision.name, arguments=decision.arguments),
    )
    content = reasoning_text(decision.call_id, reasoning_tokens) if reasoning_tokens else None
    return AssistantMessage(content=content, tool_calls=[call])


def _padded(message: AssistantMessage, padding: str) -> AssistantMessage:
    if not padding:
        return message
    return message.model_copy(update={"content": (message.content or "") + padding})


def _is_start_check(chat: ChatCompletionRequest) -> bool:
    """The engine start check's probe (:data:`START_CHECK_PROMPT`), which no fault counts."""
    asked = [{"role": m.role, "content": m.text} for m in chat.messages]
    return asked == START_CHECK_PROMPT


def _cut(message: AssistantMessage, prefix: str) -> AssistantMessage:
    """What is left of ``message`` to generate after ``prefix`` of its content."""
    if not prefix:
        return message
    rest = (message.content or "")[len(prefix) :]
    if message.tool_calls:
        return AssistantMessage(content=rest or None, tool_calls=message.tool_calls)
    return AssistantMessage(content=rest)


def _pieces(text: str) -> list[str]:
    return [text[i : i + _STREAM_PIECE_CHARS] for i in range(0, len(text), _STREAM_PIECE_CHARS)]


def _deltas(message: AssistantMessage) -> list[Delta]:
    """Content in pieces, then each tool call's head and its arguments in pieces."""
    if not message.tool_calls:
        return [
            Delta(role="assistant", content=""),
            *(Delta(content=p) for p in _pieces(message.content or "")),
        ]
    deltas = [Delta(role="assistant")]
    if message.content:
        deltas += [Delta(content=p) for p in _pieces(message.content)]
    for call in message.tool_calls:
        deltas += _tool_call_deltas(call)
    return deltas


def _tool_call_deltas(call: ToolCall) -> list[Delta]:
    head = ToolCallDelta(
        index=0,
        id=call.id,
        type="function",
        function=FunctionDelta(name=call.function.name, arguments=""),
    )
    tail = (
        Delta(tool_calls=[ToolCallDelta(index=0, function=FunctionDelta(arguments=p))])
        for p in _pieces(call.function.arguments)
    )
    return [Delta(tool_calls=[head]), *tail]


def _token_deltas(message: AssistantMessage) -> list[tuple[Delta, int]]:
    """One delta per decoded token (with how many tokens it carries), as an engine streams
    at one token a chunk: the role, each content token, each tool call's head (its marker,
    name and arguments marker tokens) then each arguments token. The end token rides on
    the finish chunk."""
    groups: list[tuple[Delta, int]] = [(Delta(role="assistant", content=""), 0)]
    groups += [(Delta(content=t.text), 1) for t in stand_in.encode(message.content or "")]
    for call in message.tool_calls or ():
        head = ToolCallDelta(
            index=0,
            id=call.id,
            type="function",
            function=FunctionDelta(name=call.function.name, arguments=""),
        )
        groups.append((Delta(tool_calls=[head]), 2 + len(stand_in.encode(call.function.name))))
        groups += [
            (
                Delta(
                    tool_calls=[ToolCallDelta(index=0, function=FunctionDelta(arguments=t.text))]
                ),
                1,
            )
            for t in stand_in.encode(call.function.arguments)
        ]
    return groups


class _Tokens:
    """One choice's stand-in token data: ids, their text, and their logprobs, from token
    ``start`` on (a continuation generates only what follows its prefix; positions, and so
    logprobs, are those of the whole message: the same as the uninterrupted call's)."""

    def __init__(self, message: AssistantMessage, seed: int, index: int, start: int = 0) -> None:
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
        whole = stand_in.message_body(message.content or "", calls)
        self.prefix_ids = [t.id for t in whole[:start]]
        self.tokens = whole[start:]
        self.ids = [t.id for t in self.tokens]
        self.logprobs = [
            stand_in.logprob(seed, index, start + pos, t.id) for pos, t in enumerate(self.tokens)
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
        self,
        settings: PolicySettings,
        request: ChatCompletionRequest,
        decisions: list[Decision],
        prefix: str = "",
        padding: str = "",
    ) -> None:
        """``prefix``: the content already generated (``continue_final_message``); the
        request's messages are then the conversation before the partial assistant one.
        ``padding``: added to every choice's content (an oversized reply, on purpose)."""
        self.id = "chatcmpl-" + os.urandom(12).hex()
        self.created = int(time.time())
        self.model = request.model or settings.model
        self.decisions = decisions
        whole = [_padded(_message(d, settings.reasoning_tokens), padding) for d in decisions]
        self.messages = [_cut(m, prefix) for m in whole]
        start = len(prefix) // _CHARS_PER_TOKEN
        self.prefix_given = bool(prefix)
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
            self.tokens = [_Tokens(m, seed, i, start) for i, m in enumerate(whole)]
            # As vLLM renders continue_final_message: the final message left open, so the
            # prefix's tokens end the prompt.
            self.prompt = _prompt_ids(request) + self.tokens[0].prefix_ids
            prompt_tokens = len(self.prompt)
            completion = sum(len(t.ids) for t in self.tokens)
        else:
            prompt_tokens = estimate_prompt_tokens(request)
            completion = settings.tokens_per_call * len(decisions)
        self.completion_tokens = completion
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
                message=self.messages[i],
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
            deltas = _deltas(self.messages[i])
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

    def timed_stream(self, *, include_usage: bool) -> list[tuple[bytes, int]]:
        """Choice 0 at one token a chunk, each chunk with the tokens it carries (to wait
        for): role, content and tool-call tokens, then the finish chunk with the end token."""
        decision, tokens = self.decisions[0], self.tokens[0] if self.tokens else None
        n = len(tokens.ids) if tokens else 0
        chunks: list[tuple[bytes, int]] = []
        at = 0
        for j, (delta, count) in enumerate(_token_deltas(self.messages[0])):
            stop = min(at + count, max(n - 1, 0))
            choice = ChunkChoice(
                index=0, delta=delta, **self._choice_tokens(0, at, stop, streamed=True)
            )
            prompt = self.prompt if j == 0 and self.return_ids and not self.sglang else None
            chunks.append((self._chunk([choice], prompt=prompt), stop - at))
            at = stop
        last = ChunkChoice(
            index=0,
            delta=Delta(),
            finish_reason=_finish_reason(decision),
            **self._choice_tokens(0, at, n, streamed=True),
        )
        chunks.append((self._chunk([last]), n - at))
        if include_usage:
            chunks.append((self._chunk([], usage=self.usage), 0))
        return [*chunks, (_SSE_DONE, 0)]

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

    def abort_chunk(self) -> bytes:
        """The chunk an engine ends an aborted generation with (finish reason ``abort``)."""
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}],
        }
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

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
        line: dict[str, Any] = {
            "id": self.id,
            "created": self.created,
            "request": asked,
            "prompt_token_ids": self.prompt,
            "choices": choices,
        }
        if self.prefix_given and self.tokens is not None:
            # Given, not generated: what this call decoded is ``token_ids`` alone.
            line["prefix_token_ids"] = self.tokens[0].prefix_ids
        return orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)


def _aborted_completion(reply: _Reply) -> bytes:
    """A plain reply to a generation a pause aborted: no message, finish reason ``abort``."""
    body = {
        "id": reply.id,
        "object": "chat.completion",
        "created": reply.created,
        "model": reply.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": ""},
                "finish_reason": "abort",
            }
        ],
        "usage": reply.usage.model_dump(),
    }
    return orjson.dumps(body)


def _spans(count: int, parts: int) -> list[tuple[int, int]]:
    """``count`` items cut into ``parts`` consecutive spans, as even as can be."""
    if parts <= 0:
        return []
    bounds = [count * k // parts for k in range(parts + 1)]
    return list(itertools.pairwise(bounds))


async def _sse(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def _timed_sse(
    chunks: list[tuple[bytes, int]],
    per_token_s: float,
    done: Callable[[int], None],
    weights: ScriptedWeights,
    generation: Generation,
    abort_chunk: bytes,
) -> AsyncIterator[bytes]:
    """The chunks at their decode pace, each sampled at a token boundary under the weights
    live then; ``done(tokens decoded)`` however the stream ends (a caller that goes away
    cuts it). Aborted by a pause: the abort chunk and ``[DONE]``."""
    decoded = 0
    weights.track(generation)
    try:
        for chunk, tokens in chunks:
            if tokens:
                try:
                    version = await weights.turn(generation)
                except Aborted:
                    yield abort_chunk
                    yield _SSE_DONE
                    return
                await asyncio.sleep(tokens * per_token_s)
                decoded += tokens
                generation.sampled(version, tokens)
            yield chunk
    finally:
        weights.end(generation)
        done(decoded)


def _continuation(
    chat: ChatCompletionRequest, settings: PolicySettings
) -> tuple[ChatCompletionRequest, str]:
    """The conversation before the partial assistant message, and that message's content,
    for a ``continue_final_message`` request (400 when it cannot be taken)."""
    last = chat.messages[-1]
    if not settings.accept_prefix:
        raise BadRequestError("continue_final_message is not supported by this engine")
    if last.role != "assistant" or last.tool_calls or len(chat.messages) < 2:
        raise BadRequestError("continue_final_message needs a final assistant message")
    if getattr(chat, "add_generation_prompt", True) is not False and settings.shape == "vllm":
        raise BadRequestError(
            "continue_final_message and add_generation_prompt cannot both be true"
        )
    return chat.model_copy(update={"messages": chat.messages[:-1]}), last.text


async def _read_request(request: Request) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        # create_app turns this into the one-line 400 that names the field.
        raise RequestValidationError(exc.errors(include_url=False)) from None


def create_policy_app(
    settings: PolicySettings, *, schedule: CollectorSchedule | None = None
) -> FastAPI:
    """``schedule``: the collector schedule to attach (default: this process's)."""
    in_flight = 0
    collector = ServerCollector(schedule, idle=lambda: in_flight == 0)

    call_log: BinaryIO | None = None
    decode_log: BinaryIO | None = None
    weights = ScriptedWeights()
    faults = FaultPlan(settings.faults)

    def note_decoded(reply_id: str, tokens: int, asked: ChatCompletionRequest) -> None:
        if decode_log is not None:
            line = {
                "id": reply_id,
                "decoded": tokens,
                "max_tokens": asked.model_extra and asked.model_extra.get("max_tokens"),
            }
            decode_log.write(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal call_log, decode_log
        collector.start()
        if settings.call_log is not None:
            # Unbuffered appends: each reply's line is in the file before the reply leaves,
            # so a run killed at any moment still has the engine's account of every call.
            call_log = open(settings.call_log, "ab", buffering=0)  # noqa: SIM115, ASYNC230
        if settings.decode_log is not None:
            decode_log = open(settings.decode_log, "ab", buffering=0)  # noqa: SIM115, ASYNC230
        if settings.weights_log is not None:
            weights.log = open(settings.weights_log, "ab", buffering=0)  # noqa: SIM115, ASYNC230
        if settings.fault_log is not None:
            faults.log = open(settings.fault_log, "ab", buffering=0)  # noqa: SIM115, ASYNC230
        try:
            yield
        finally:
            if weights.log is not None:
                weights.log.close()
            if call_log is not None:
                call_log.close()
            if decode_log is not None:
                decode_log.close()
            if faults.log is not None:
                faults.log.close()
            await collector.aclose()

    app = create_app("scripted-policy", lifespan=lifespan, data_token=data_token())
    app.state.weights = weights
    if settings.pause_routes:
        mount_weight_routes(app, weights)
    playbook = Playbook(
        seed=settings.seed, error_rate=settings.error_rate, tool_turns=settings.tool_turns
    )
    delay_s = settings.latency_ms / 1000
    token_delay_s = settings.token_latency_ms / 1000
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
        await weights.admit()
        asked, prefix = chat, ""
        if getattr(chat, "continue_final_message", False) is True:
            chat, prefix = _continuation(chat, settings)
        decisions = [playbook.decide(chat if i == 0 else _reseeded(chat, i)) for i in range(chat.n)]
        faulty = bool(settings.faults) and not _is_start_check(asked)
        padding = faults.padding() if faulty else ""
        reply = _Reply(settings, chat, decisions, prefix, padding)
        if padding:
            faults.note_padding(reply.id, len(padding))
        if prefix:
            whole = _message(decisions[0], settings.reasoning_tokens).content or ""
            if len(prefix) % _CHARS_PER_TOKEN or not whole.startswith(prefix):
                # Deterministic by design: only a prefix this engine itself produced.
                raise BadRequestError("the final assistant message is not a prefix of this call")
        if call_log is not None:
            call_log.write(reply.log_line(asked))
        timed = token_delay_s > 0 and reply.tokens is not None
        streamed_timed = timed and chat.stream and chat.n == 1
        # A paced stream is in flight once its body runs (a caller gone before that never
        # started it: nothing for a pause to wait for).
        generation = Generation(reply.id) if streamed_timed else weights.start(reply.id)
        if not timed:
            # Sampled at once, under the weights live now.
            generation.sampled(weights.version, reply.completion_tokens)
        if delay_s > 0 or (timed and not streamed_timed):
            in_flight += 1
            decoded = 0
            try:
                await asyncio.sleep(delay_s)
                if timed and not streamed_timed:
                    for _ in range(reply.completion_tokens):
                        version = await weights.turn(generation)
                        await asyncio.sleep(token_delay_s)
                        decoded += 1
                        generation.sampled(version, 1)
            except Aborted:
                generation.aborted = True
            finally:
                in_flight -= 1
                if timed and not streamed_timed:
                    note_decoded(reply.id, decoded, asked)
                if not streamed_timed:
                    weights.end(generation)
            if generation.aborted:
                return Response(_aborted_completion(reply), media_type="application/json")
        if not streamed_timed and generation.id in weights.active:
            weights.end(generation)
        if not chat.stream:
            return Response(reply.completion(), media_type="application/json")
        include_usage = chat.stream_options is not None and chat.stream_options.include_usage
        tool_call = not isinstance(decisions[0], FinalDecision)
        if streamed_timed:
            timed_chunks = reply.timed_stream(include_usage=include_usage)
            if faulty:
                spoiled = faults.corrupt_stream(reply.id, [c for c, _ in timed_chunks], tool_call)
                timed_chunks = list(zip(spoiled, (n for _, n in timed_chunks), strict=True))
            body = _timed_sse(
                timed_chunks,
                token_delay_s,
                lambda n: note_decoded(reply.id, n, asked),
                weights,
                generation,
                reply.abort_chunk(),
            )
            return StreamingResponse(_counted(body), media_type="text/event-stream")
        chunks = reply.stream(include_usage=include_usage)
        if faulty:
            chunks = faults.corrupt_stream(reply.id, chunks, tool_call)
        return StreamingResponse(_sse(chunks), media_type="text/event-stream")

    async def _counted(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        # A decoding stream holds its call: no full collection while it runs.
        nonlocal in_flight
        in_flight += 1
        try:
            async for chunk in body:
                yield chunk
        finally:
            in_flight -= 1

    return app
