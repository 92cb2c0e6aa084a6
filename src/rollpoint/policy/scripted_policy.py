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

Does not own: what to answer (:mod:`rollpoint.policy.playbook`), the payload shapes
(:mod:`rollpoint.policy.openai_wire`), or how one reply's messages, usage and token data are
rendered as a completion or as chunks (:mod:`rollpoint.policy.scripted_reply`); its
settings are :mod:`rollpoint.policy.scripted_settings`'s. Starting the process is the
runtime's job.

This is the hot path of every benchmark: the body is parsed once by pydantic's JSON parser
(which also refuses lone surrogates, so nothing unencodable reaches the response), and the
response is rendered straight from our models, with no second validation pass.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import BinaryIO

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from rollpoint.http.app import create_app
from rollpoint.http.auth import data_token
from rollpoint.policy.engine_check import START_CHECK_PROMPT
from rollpoint.policy.openai_wire import (
    ChatCompletionRequest,
    ModelCard,
    ModelList,
)
from rollpoint.policy.playbook import FinalDecision, Playbook
from rollpoint.policy.scripted_faults import FaultPlan
from rollpoint.policy.scripted_reply import (
    CHARS_PER_TOKEN,
    SSE_DONE,
    ScriptedReply,
    aborted_completion,
    assistant_message,
    choice_seed,
)
from rollpoint.policy.scripted_settings import PolicySettings
from rollpoint.policy.scripted_weights import (
    Aborted,
    Generation,
    ScriptedWeights,
    mount_weight_routes,
)
from rollpoint.protocol.errors import BadRequestError, ModelNotFoundError
from rollpoint.tuning.collector_schedule import CollectorSchedule, ServerCollector

__all__ = ["PolicySettings", "create_policy_app"]
"""The server's interface: its app, and the settings it is made with (kept in
:mod:`.scripted_settings`)."""


def _reseeded(request: ChatCompletionRequest, index: int) -> ChatCompletionRequest:
    return request.model_copy(update={"seed": choice_seed(request.seed, index)})


def _is_start_check(chat: ChatCompletionRequest) -> bool:
    """The engine start check's probe (:data:`START_CHECK_PROMPT`), which no fault counts."""
    asked = [{"role": m.role, "content": m.text} for m in chat.messages]
    return asked == START_CHECK_PROMPT


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
                    yield SSE_DONE
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
        reply = ScriptedReply(settings, chat, decisions, prefix, padding)
        if padding:
            faults.note_padding(reply.id, len(padding))
        if prefix:
            whole = assistant_message(decisions[0], settings.reasoning_tokens).content or ""
            if len(prefix) % CHARS_PER_TOKEN or not whole.startswith(prefix):
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
                return Response(aborted_completion(reply), media_type="application/json")
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
