"""The model server: an OpenAI-compatible proxy in front of the inference engine.

Owns: ``POST /v1/chat/completions`` (plain and ``stream: true``) and ``GET /v1/models``
proxied to ``upstream_url``, and ``GET /v1/models/{id}`` answered from the upstream's list
(engines differ on whether they serve it; an id not listed is 404 ``model_not_found``); the :class:`~rollpoint.participant.admission_gate.AdmissionGate` every
completion passes; the :class:`~rollpoint.servers.model.call_ledger.CallLedger` that files each call
carrying the episode headers; the policy version stamped on every completion (reply header
``x-rollpoint-policy-version`` and the ledger record); and the routes
``GET /rollpoint/v1/calls``, ``POST /rollpoint/v1/policy_version``, ``GET /rollpoint/v1/stats``,
``POST /rollpoint/v1/weights/pause`` and ``POST /rollpoint/v1/weights/live`` (a weight update:
:mod:`rollpoint.servers.model.weight_switch`);
and ``GET /metrics`` (calls, in flight, waiting at the gate, latency, tokens of recorded calls).

Does not own: checkpoint control (with ``snapshot_root`` set, the control routes are mounted
and :class:`~rollpoint.servers.model.model_participant.ModelParticipant` lets the fence close and open
the gate and export the ledger), nor OpenAI validation beyond "a JSON object with a messages
list": the engine judges the rest.

Retired attempts: a call whose episode headers name an attempt at or under its rollout's
retire mark is refused with 409 ``stale_attempt`` before it reaches the engine; a call
retired while it ran gets the same refusal instead of its reply, and is not recorded (a
stream already under way ends as it began, unrecorded).

Upstream failures: unreachable, timed out or a 5xx → 502 ``transport_error``; a 4xx is passed
through with its status and body (the engine refused the request, not the plumbing). A
tagged call whose reply has neither content nor tool calls is a 502 too, and not recorded
(:func:`~rollpoint.policy.engine_adapters.check_said`), and so is a stream from the engine
that ends before choice 0 has a finish reason (cut short: llama.cpp's server ends a stream
with ``[DONE]`` when another request waits); a streamed caller's such stream is relayed as
it came and not recorded.

Token data: each recorded call keeps choice 0's token ids and logprobs, read by the engine
adapter of ``engine`` (:mod:`rollpoint.policy.engine_adapters`), streamed or not. A plain
reply whose token data is malformed is refused with 502 ``transport_error`` naming the field
and the engine, and nothing is recorded; a stream is relayed as it came and, malformed, left
unrecorded (logged).

Generation cut (``cut_generations``: on with token capture where the start check found the
engine's stream carries ids and it continues a partial message,
:mod:`rollpoint.policy.engine_check`): a tagged one-choice plain call is sent upstream streamed and its plain reply
assembled from the chunks (the engine's fields, in its order), so :attr:`ModelServer.partials`
always holds the output so far of every such call (streamed callers' too); a call whose
rollout has a saved prefix installed (:attr:`ModelServer.prefixes`) continues from it, or
is decoded from scratch with the refusal counted (:mod:`rollpoint.servers.model.generation_cut`).
An engine that answers a streamed request with plain JSON is passed through as it answered.

Versions: a call is stamped with the version its first token was sampled under (the one
live when it started, unless a weight update began before it sampled anything); a call
that spans an update in ``keep`` mode carries the segments of each version, on the ledger
record and in the reply's ``x-rollpoint-token-segments`` header, as a continued call does.
A call the engine aborted for a weight update is sent again once the new weights are live.

This is the hot path of every policy call. The plain path reads the body once, parses it
once, forwards the same bytes over one aiohttp session, and returns the engine's bytes;
only calls carrying episode headers parse the reply, to record it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from itertools import islice
from typing import Annotated, Any

import aiohttp
import orjson
from fastapi import FastAPI, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import Receive, Scope, Send
from yarl import URL

from rollpoint.http.auth import data_token
from rollpoint.http.client import HttpClient
from rollpoint.http.server_metrics import CALL_BUCKETS, Reading, ServerMetrics
from rollpoint.participant import AdmissionGate
from rollpoint.policy.engine_adapters import EngineTokens, TokenStream, adapter_for, check_said
from rollpoint.policy.stream_chunk_check import check_chunk
from rollpoint.protocol.errors import (
    BadRequestError,
    ModelNotFoundError,
    StaleAttemptError,
    TransportError,
)
from rollpoint.protocol.ids import (
    HEADER_ATTEMPT,
    HEADER_POLICY_VERSION,
    HEADER_ROLLOUT_ID,
    HEADER_TURN,
    MAX_ATTEMPT,
    EpisodeId,
    Identifier,
    is_identifier,
)
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.token_data import TokenSegment, TokenTrace
from rollpoint.servers.model.call_journal import CallJournal, open_call_journal
from rollpoint.servers.model.call_ledger import CallLedger, CallRecord
from rollpoint.servers.model.generation_cut import (
    HEADER_TOKEN_SEGMENTS,
    STREAMS_TOKEN_IDS,
    CallPrefix,
    CutCounts,
    FrozenPartial,
    PartialCall,
    continuation_body,
    refusal,
    request_digest,
    segments_header,
    stitch,
)
from rollpoint.servers.model.model_participant import ModelParticipant
from rollpoint.servers.model.weight_switch import LiveRequest, PauseRequest, WeightSwitch
from rollpoint.servers.server_app import control_plane, create_server_app

log = logging.getLogger(__name__)

_UPSTREAM_ERRORS = (TimeoutError, aiohttp.ClientError, OSError)
MAX_ABORTS = 3
"""Times one call is sent again after the engine aborted it (a weight update each)."""


class ModelServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    upstream_url: str
    """OpenAI-compatible base URL of the engine, ending in ``/v1``."""
    name: Identifier = "model"
    replica: Identifier = "replica-0"
    api_key: str | None = None
    """Sent upstream as ``Authorization: Bearer``; the callers' own auth is never forwarded."""
    engine: str = "vllm"
    """The reply shape token data is read from, when a reply carries any."""
    upstream_data_token: bool = False
    """Send this server's data token (``$ROLLPOINT_DATA_TOKEN``) upstream when ``api_key``
    is None: the built-in scripted policy guards its routes with it. Never set for an
    engine of the user's, which must not see the run's token."""
    call_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    """Upper bound on one upstream call, a whole stream included."""
    snapshot_root: str | None = None
    """Snapshot store root (local path or fsspec URL); set, it mounts the control routes
    (token from ``ROLLPOINT_CONTROL_TOKEN``). None: a plain data server."""
    lease_grace_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 2.0
    """A checkpoint's lease lapses this long after its deadline, then the gate reopens."""
    clock_skew_s: Annotated[float, Field(allow_inf_nan=False)] = 0.0
    """Fault injection: the control clock runs this far ahead (``rollpoint chaos``)."""
    cut_generations: bool = False
    """Stream every tagged one-choice call from the engine (a plain caller still gets a
    plain reply), so a snapshot saves the prefix of each call in flight and the
    replacement call after a restore continues it (:mod:`rollpoint.servers.model.generation_cut`).
    On with ``policy.capture_tokens`` (a prefix needs token ids)."""
    continue_prefixes: bool = True
    """False: the engine cannot take a prefix; saved prefixes are regenerated (counted)."""
    journal: bool = False
    """Journal every finished plain policy call in the snapshot store before its reply is
    returned, and answer a restored episode's call again from it
    (:mod:`rollpoint.servers.model.call_journal`); needs a local ``snapshot_root``."""
    journal_window_s: Annotated[float, Field(ge=0, le=1)] = 0.002
    """The journal's group-commit window."""


class PolicyVersionRequest(StrictModel):
    version: Annotated[int, Field(ge=0)]


class EpisodeTag:
    """The episode headers of one call, parsed and checked."""

    __slots__ = ("attempt", "rollout_id", "turn")

    def __init__(self, rollout_id: str, attempt: int, turn: int) -> None:
        self.rollout_id = rollout_id
        self.attempt = attempt
        self.turn = turn

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> EpisodeTag | None:
        """None when the call carries no episode headers; 400 naming a bad or missing one."""
        rollout_id = headers.get(HEADER_ROLLOUT_ID)
        attempt = headers.get(HEADER_ATTEMPT)
        turn = headers.get(HEADER_TURN)
        if rollout_id is None and attempt is None and turn is None:
            return None
        if rollout_id is None or not is_identifier(rollout_id):
            raise BadRequestError(f"header {HEADER_ROLLOUT_ID} must be an identifier")
        return cls(rollout_id, _header_int(HEADER_ATTEMPT, attempt), _header_int(HEADER_TURN, turn))

    @property
    def episode(self) -> EpisodeId:
        # Both parts were checked by from_headers: skip a second validation on the hot path.
        return EpisodeId.model_construct(rollout_id=self.rollout_id, attempt=self.attempt)


class RunningCalls:
    """Tagged calls past the gate and not finished, by rollout and attempt; O(1) per call."""

    def __init__(self) -> None:
        self._by_rollout: dict[str, dict[int, int]] = {}

    @contextmanager
    def track(self, tag: EpisodeTag | None) -> Iterator[None]:
        if tag is None:
            yield
            return
        attempts = self._by_rollout.setdefault(tag.rollout_id, {})
        attempts[tag.attempt] = attempts.get(tag.attempt, 0) + 1
        try:
            yield
        finally:
            left = attempts[tag.attempt] - 1
            if left:
                attempts[tag.attempt] = left
            else:
                del attempts[tag.attempt]
                if not attempts:
                    del self._by_rollout[tag.rollout_id]

    def attempts(self, rollout_id: str) -> list[int]:
        """The attempts of ``rollout_id`` with a call running now."""
        return sorted(self._by_rollout.get(rollout_id, ()))

    def keys(self, limit: int) -> list[str]:
        """Up to ``limit`` episode keys with a call running now."""
        every = (
            f"{rollout_id}#{attempt}"
            for rollout_id, attempts in self._by_rollout.items()
            for attempt in attempts
        )
        return list(islice(every, limit))


def _header_int(name: str, value: str | None) -> int:
    # ASCII digits only (str.isdigit() takes "²", which int() refuses), and no more than an
    # EpisodeId holds: a header of 10**23 once broke every later commit of its rollout.
    if (
        value is None
        or not (value.isascii() and value.isdigit())
        or len(value) > len(str(MAX_ATTEMPT))
        or int(value) > MAX_ATTEMPT
    ):
        raise BadRequestError(
            f"header {name} must be an integer from 0 to {MAX_ATTEMPT}, got {value[:40]!r}"
            if value is not None
            else f"header {name} must be an integer from 0 to {MAX_ATTEMPT}, got none"
        )
    return int(value)


def _clean_message(message: Mapping[str, Any]) -> dict[str, Any]:
    # Engines pad messages with nulls (refusal, audio, ...): keep what was said, and content
    # (null next to tool calls), the same shape the agent keeps in its transcript.
    cleaned = {k: v for k, v in message.items() if v is not None}
    cleaned.setdefault("content", None)
    return cleaned


def _usage_tokens(usage: Any) -> tuple[int, int]:
    if not isinstance(usage, dict):
        return 0, 0
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (
        prompt if isinstance(prompt, int) else 0,
        completion if isinstance(completion, int) else 0,
    )


class StreamAssembler:
    """Rebuilds the assistant message of choice 0 from OpenAI SSE chunks as they pass by."""

    def __init__(
        self,
        tokens: TokenStream | None = None,
        partial: PartialCall | None = None,
        engine: str = "engine",
    ) -> None:
        self.engine = engine
        """Named by a chunk's refusal (:mod:`rollpoint.policy.stream_chunk_check`)."""
        self.tokens = tokens
        """Fed every parsed event: the engine adapter's reader of the stream's token data."""
        self.partial = partial
        """Fed every parsed event too: the call's partial output, for the generation cut."""
        self.created: Any = None
        self.model: Any = None
        self._buf = bytearray()
        self._content: list[str] = []
        self._role = "assistant"
        self._tools: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.completion_id: str | None = None

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        while (end := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:end]).strip()
            del self._buf[: end + 1]
            if line.startswith(b"data:"):
                self._event(line[5:].strip())

    def _event(self, data: bytes) -> None:
        if not data or data == b"[DONE]":
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(event, dict):
            return
        check_chunk(self.engine, event)  # before anything keeps a piece of it
        if self.tokens is not None:
            self.tokens.feed(event)
        if self.partial is not None:
            self.partial.feed(event)
        if isinstance(event.get("id"), str):
            self.completion_id = event["id"]
        if self.created is None:
            self.created, self.model = event.get("created"), event.get("model")
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        if isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        if isinstance(delta.get("role"), str):
            self._role = delta["role"]
        if isinstance(delta.get("content"), str):
            self._content.append(delta["content"])
        for call in delta.get("tool_calls") or ():
            if isinstance(call, dict):
                self._tool_delta(call)

    def _tool_delta(self, call: dict[str, Any]) -> None:
        index = call.get("index", 0)
        entry = self._tools.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        fn = call.get("function")
        if isinstance(fn, dict):
            if isinstance(fn.get("name"), str) and fn["name"]:
                entry["function"]["name"] = fn["name"]
            if isinstance(fn.get("arguments"), str):
                entry["function"]["arguments"] += fn["arguments"]

    def check_finished(self, upstream: str) -> None:
        """Raise :class:`TransportError` when the stream ended with no finish reason for
        choice 0: it was cut short, and what came is not the engine's whole reply."""
        if self.finish_reason is None:
            raise TransportError(
                f"upstream {upstream}: the stream ended before choice 0 finished (no finish_reason)"
            )

    def message(self) -> dict[str, Any]:
        return _clean_message(self.reply_message())

    def reply_message(self) -> dict[str, Any]:
        """The message as a plain reply carries it (content null next to tool calls)."""
        # An empty string the engine streamed is its content; no content delta at all is
        # none (and so is the empty content next to tool calls, as a plain reply has it).
        content = "".join(self._content) if self._content else None
        message: dict[str, Any] = {"role": self._role, "content": content}
        if self._tools:
            message["content"] = content or None
            message["tool_calls"] = [self._tools[i] for i in sorted(self._tools)]
        return message

    def reply(self, partial: PartialCall, ids_from: int, entries_from: int) -> dict[str, Any]:
        """The plain ``chat.completion`` the engine would have answered, from the stream
        (in the order of OpenAI's and vLLM's fields; a continuation's own tokens only)."""
        choice: dict[str, Any] = {
            "index": 0,
            "message": self.reply_message(),
            "finish_reason": self.finish_reason,
            "logprobs": (
                {"content": partial.entries[entries_from:]} if partial.saw_logprobs else None
            ),
        }
        if partial.saw_ids:
            choice["token_ids"] = partial.ids[ids_from:]
        reply: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage,
        }
        if partial.prompt is not None:
            reply["prompt_token_ids"] = partial.prompt
        return reply


@dataclass(slots=True)
class _Upstream:
    """How the engine answered a streamed request: refused, streamed, or plain JSON."""

    refusal: tuple[int, str, bytes] | None = None
    assembler: StreamAssembler | None = None
    plain: bytes | None = None


class _HeldStream(StreamingResponse):
    """A streamed reply that releases the upstream response and the gate however it ends.

    Starlette may never start the body iterator (client gone early), so cleanup cannot live
    in the iterator's ``finally``.
    """

    def __init__(self, body: AsyncIterator[bytes], stack: AsyncExitStack, **kw: Any) -> None:
        super().__init__(body, **kw)
        self._stack = stack

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stack.aclose()


class ModelServer:
    """The state behind one model server app: gate, ledger, policy version, upstream client."""

    def __init__(self, settings: ModelServerSettings) -> None:
        self.settings = settings
        self.gate = AdmissionGate()
        self.ledger = CallLedger()
        self.journal: CallJournal | None = None
        self.running = RunningCalls()
        self.attempt_guard: Callable[[EpisodeId], None] | None = None
        """Raises :class:`StaleAttemptError` for a retired attempt (the fence's check)."""
        self.policy_version = 0
        self.calls_total = 0
        self.partials: dict[int, PartialCall] = {}
        """The output so far of every call streamed from the engine now (generation cut)."""
        self.prefixes: dict[str, CallPrefix] = {}
        """Saved prefixes installed by a restore, by rollout, until its replacement call."""
        self.cut = CutCounts()
        self._adapter = adapter_for(settings.engine)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        """Tokens of the recorded calls (those with episode headers), from the engine's usage."""
        self.metrics = ServerMetrics(server=settings.name, replica=settings.replica)
        self.metrics.read(self._readings)
        self.call_seconds = self.metrics.histogram(
            "rollpoint_model_call_seconds",
            "Policy calls: admitted at the gate to the engine's last byte",
            CALL_BUCKETS,
        )
        # An engine whose stream carries no token ids (SGLang's OpenAI server) gives no
        # prefix to save: its calls are proxied as they come.
        self._cut = settings.cut_generations and self._adapter.name in STREAMS_TOKEN_IDS
        self._client: HttpClient | None = None
        base = settings.upstream_url.rstrip("/")
        # Parsed once: aiohttp would parse a str URL again on every call.
        self._completions_url = URL(f"{base}/chat/completions")
        self._models_url = f"{base}/models"
        self._upstream_headers = {"content-type": "application/json"}
        upstream_key = settings.api_key
        if upstream_key is None and settings.upstream_data_token:
            upstream_key = data_token()
        if upstream_key:
            self._upstream_headers["authorization"] = f"Bearer {upstream_key}"
        self.upstream_control_headers = {
            k: v for k, v in self._upstream_headers.items() if k != "content-type"
        }
        self.weights = WeightSwitch(self, can_split=lambda: self._cut)
        self.aborted_calls = 0
        """Calls the engine aborted for a weight update, sent again after it."""

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise RuntimeError("model server is not started")
        return self._client.session

    async def start(self) -> None:
        self._client = HttpClient(timeout_s=self.settings.call_timeout_s)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.settings.name,
            "replica": self.settings.replica,
            "in_flight": self.gate.in_flight,
            "waiting": self.gate.waiting,
            "calls_total": self.calls_total,
            "recorded_calls": self.ledger.count,
            "policy_version": self.policy_version,
            "gate_open": self.gate.is_open,
            "generation_cut": self.cut.as_dict(),
            "weights": {
                "phase": str(self.weights.phase),
                "updates": self.weights.updates,
                "aborted_calls": self.aborted_calls,
            },
        }

    def _readings(self) -> list[Reading]:
        return [
            Reading("rollpoint_model_calls", "Policy calls answered", self.calls_total, "counter"),
            Reading("rollpoint_model_calls_in_flight", "Calls past the gate", self.gate.in_flight),
            Reading("rollpoint_model_calls_waiting", "Calls held at the gate", self.gate.waiting),
            Reading("rollpoint_model_gate_open", "1 while the gate admits", int(self.gate.is_open)),
            Reading(
                "rollpoint_model_tokens",
                "Tokens of recorded calls, by kind",
                self.prompt_tokens,
                "counter",
                {"kind": "prompt"},
            ),
            Reading(
                "rollpoint_model_tokens",
                "Tokens of recorded calls, by kind",
                self.completion_tokens,
                "counter",
                {"kind": "completion"},
            ),
            Reading(
                "rollpoint_model_recorded_calls", "Calls in the call ledger", self.ledger.count
            ),
            Reading("rollpoint_model_policy_version", "Policy version", self.policy_version),
            Reading(
                "rollpoint_model_calls_continued",
                "Replacement calls continued from a saved generation prefix",
                self.cut.continued,
                "counter",
            ),
            Reading(
                "rollpoint_model_tokens_spared",
                "Decode tokens a continued call did not generate again (its prefix)",
                self.cut.continued_tokens,
                "counter",
            ),
            *(
                Reading(
                    "rollpoint_model_calls_regenerated",
                    "Replacement calls decoded from scratch instead of continued, by reason",
                    count,
                    "counter",
                    {"reason": reason},
                )
                for reason, count in sorted(self.cut.regenerated.items())
            ),
        ]

    def cut_state(self, scope: Mapping[str, int]) -> list[FrozenPartial | CallPrefix]:
        """In the pause, O(calls): the in-flight calls of the scoped episodes (their lengths
        only) and the installed prefixes of scoped rollouts still waiting for their call."""
        out: list[FrozenPartial | CallPrefix] = [
            p.freeze() for p in self.partials.values() if scope.get(p.rollout_id) == p.attempt
        ]
        out.extend(p for r, p in self.prefixes.items() if r in scope)
        return out

    def _take_prefix(self, tag: EpisodeTag | None) -> CallPrefix | None:
        """The saved prefix a replacement call continues: same rollout and turn, a later
        attempt. A prefix its rollout has moved past is dropped."""
        if tag is None:
            return None
        prefix = self.prefixes.get(tag.rollout_id)
        if prefix is None or prefix.attempt >= tag.attempt:
            return None
        del self.prefixes[tag.rollout_id]
        return prefix if prefix.turn == tag.turn else None

    async def chat_completions(self, request: Request) -> Response:
        body = await request.body()
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise BadRequestError("request body is not valid JSON") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
            raise BadRequestError("request body must be a JSON object with a 'messages' list")
        tag = EpisodeTag.from_headers(request.headers)
        self._guard(tag)
        if not self.weights.is_live:
            await self.weights.wait_live()  # it starts under the new weights
        cut = self._cut
        if payload.get("stream") is True:
            # A streamed caller is relayed as it comes: its saved prefix is not continued.
            regenerated = None
            if cut and tag is not None and self._take_prefix(tag) is not None:
                regenerated = "streamed_caller"
                self._refused(tag, regenerated)
            return await self._stream(body, payload, tag, regenerated)
        if cut and tag is not None:
            if payload.get("n", 1) in (1, None):
                return await self._plain_cut(body, payload, tag)
            if self._take_prefix(tag) is not None:
                self._refused(tag, "choices")
        async with self.gate.admit():
            # Again: the attempt may have been retired while the call waited at the gate.
            self._guard(tag)
            with self.running.track(tag):
                aborts = 0
                while True:
                    version = self.policy_version
                    started = time.perf_counter()
                    status, content_type, raw = await self._post_upstream(body)
                    latency = time.perf_counter() - started
                    # Only once a weight update was ever asked for: no scan on other calls.
                    if not (self.weights.touched and _plain_aborted(status, raw)):
                        break
                    aborts += 1
                    await self._after_abort(tag, aborts)
        self.calls_total += 1
        self.call_seconds.observe(latency)
        if status >= 400:
            return self._upstream_refusal(status, content_type, raw)
        if tag is not None:
            # Retired while it ran: its caller was stopped, so the reply is refused, not filed.
            self._guard(tag)
            self._record_reply(tag, payload, raw, version, latency)
        return Response(raw, media_type=content_type, headers={HEADER_POLICY_VERSION: str(version)})

    async def _after_abort(self, tag: EpisodeTag | None, aborts: int) -> None:
        """The engine aborted the call for a weight update: send it again once it is over
        (a call aborted :data:`MAX_ABORTS` times fails, as a transport error)."""
        if aborts > MAX_ABORTS:
            raise TransportError(
                f"upstream {self.settings.upstream_url} aborted the call {aborts} times"
            )
        self.aborted_calls += 1
        log.info("call aborted for a weight update; sent again once the weights are live")
        await self.weights.wait_live()
        self._guard(tag)

    async def _stream_again_if_aborted(
        self, tag: EpisodeTag, body: dict[str, Any], partial: PartialCall
    ) -> tuple[_Upstream, PartialCall]:
        """Stream ``body``; a stream the engine aborted for a weight update is streamed
        again, from the same start, once the new weights are live."""
        aborts = 0
        while True:
            start = partial.clone_start()
            up = await self._stream_upstream(body, partial)
            if up.assembler is None or up.assembler.finish_reason != "abort":
                return up, partial
            aborts += 1
            await self._after_abort(tag, aborts)
            partial = start
            partial.version = self.policy_version

    def _refused(self, tag: EpisodeTag, reason: str) -> None:
        self.cut.refused(reason)
        log.info("saved prefix of %s turn %d regenerated: %s", tag.rollout_id, tag.turn, reason)

    async def _plain_cut(
        self, raw_body: bytes, payload: dict[str, Any], tag: EpisodeTag
    ) -> Response:
        """A plain call streamed from the engine (its partial output known throughout),
        continued from its saved prefix when there is one and nothing refuses it."""
        prefix = self._take_prefix(tag)
        reason: str | None = None
        asked = request_digest(raw_body)
        async with self.gate.admit():
            self._guard(tag)
            with self.running.track(tag):
                version = self.policy_version
                started = time.perf_counter()
                up: _Upstream | None = None
                if prefix is not None:
                    reason = refusal(
                        payload,
                        prefix,
                        engine=self._adapter.name,
                        enabled=self.settings.continue_prefixes,
                        policy_version=version,
                        request=asked,
                    )
                if prefix is not None and reason is None:
                    partial = PartialCall.continuing(
                        prefix, attempt=tag.attempt, version=version, prompt=prefix.prompt()
                    )
                    body = continuation_body(payload, prefix, self._adapter.name)
                    up, partial = await self._stream_again_if_aborted(tag, body, partial)
                    if up.refusal is not None:
                        # An engine that cannot take the prefix says so with a 4xx.
                        reason, up = "engine_refused", None
                if up is None:
                    partial = PartialCall(
                        tag.rollout_id, tag.attempt, tag.turn, version, request=asked
                    )
                    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
                    up, partial = await self._stream_again_if_aborted(tag, body, partial)
                latency = time.perf_counter() - started
        self.calls_total += 1
        if up.refusal is not None:
            return self._upstream_refusal(*up.refusal)
        continued = prefix is not None and reason is None
        raw = up.plain
        if raw is not None:
            # An engine that answers plain JSON to a streamed request: its reply as it is.
            try:
                reply = orjson.loads(raw)
                if not isinstance(reply["choices"][0]["message"], dict):
                    raise TypeError
            except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
                raise TransportError("upstream reply is not an OpenAI chat completion") from None
            fresh = len(reply["choices"][0].get("token_ids") or ())
        else:
            assert up.assembler is not None
            # A continuation's partial starts with the prefix: the reply holds its own
            # tokens, and the prefix goes back in front when it is stitched.
            skip_ids = skip_entries = 0
            if continued and prefix is not None:
                skip_ids = prefix.count
                skip_entries = prefix.count if prefix.completion_logprobs is not None else 0
            # A stream that ends before choice 0 has a finish reason was cut short (llama.cpp's
            # server ends one with [DONE] when another request waits): no reply, a failure.
            up.assembler.check_finished(self.settings.upstream_url)
            reply = up.assembler.reply(partial, skip_ids, skip_entries)
            fresh = len(partial.ids) - skip_ids
        segments = None
        spans = partial.segments() if raw is None else []
        if not continued and spans:
            # The version its first token was sampled under; more than one: it spanned a
            # weight update (keep mode) and carries each version's run.
            version = spans[0].policy_version
            if len(spans) > 1:
                segments = spans
        headers = {HEADER_POLICY_VERSION: str(version)}
        if segments is not None:
            headers[HEADER_TOKEN_SEGMENTS] = segments_header(segments)
        if continued and prefix is not None:
            segments = spans or [
                *prefix.segments,
                TokenSegment(policy_version=version, tokens=fresh),
            ]
            stitch(reply, prefix)
            raw = None
            self.cut.continued += 1
            self.cut.continued_tokens += prefix.count
            headers[HEADER_TOKEN_SEGMENTS] = segments_header(segments)
        elif prefix is not None and reason is not None:
            self._refused(tag, reason)
        # Retired while it ran: its caller was stopped, so the reply is refused, not filed.
        self._guard(tag)
        choice = reply["choices"][0]
        # Malformed token data raises here: the call fails whole and nothing is filed.
        read = self._adapter.read(reply)
        self._record(
            tag,
            payload,
            _clean_message(choice["message"]),
            choice.get("finish_reason"),
            reply.get("usage"),
            version=version,
            latency=latency,
            streamed=False,
            read=read,
            completion_id=reply.get("id"),
            segments=segments,
            continued_tokens=prefix.count if segments is not None and prefix is not None else 0,
            regenerated=reason,
        )
        body_out = raw if raw is not None else orjson.dumps(reply)
        return Response(body_out, media_type="application/json", headers=headers)

    async def _stream_upstream(self, body: dict[str, Any], partial: PartialCall) -> _Upstream:
        """POST ``body`` (streamed) and read the whole stream, ``partial`` kept current and
        listed in :attr:`partials` while it runs; or the engine's refusal (status >= 400),
        or its plain reply when it answered JSON."""
        key = id(partial)
        self.partials[key] = partial
        try:
            async with self.session.post(
                self._completions_url, data=orjson.dumps(body), headers=self._upstream_headers
            ) as resp:
                if resp.status >= 400:
                    return _Upstream(refusal=(resp.status, resp.content_type, await resp.read()))
                if resp.content_type != "text/event-stream":
                    return _Upstream(plain=await resp.read())
                assembler = StreamAssembler(partial=partial, engine=self._adapter.name)
                async for chunk in resp.content.iter_any():
                    assembler.feed(chunk)
                assembler.feed(b"\n")
                return _Upstream(assembler=assembler)
        except _UPSTREAM_ERRORS as exc:
            raise self._unreachable(exc) from None
        finally:
            del self.partials[key]

    def _guard(self, tag: EpisodeTag | None) -> None:
        if tag is not None and self.attempt_guard is not None:
            self.attempt_guard(tag.episode)

    async def models(self) -> Response:
        try:
            async with self.session.get(self._models_url, headers=self._upstream_headers) as resp:
                raw = await resp.read()
                status, content_type = resp.status, resp.content_type
        except _UPSTREAM_ERRORS as exc:
            raise self._unreachable(exc) from None
        if status >= 400:
            return self._upstream_refusal(status, content_type, raw)
        return Response(raw, media_type=content_type)

    async def model(self, model_id: str) -> Response:
        """One model's card, found in the upstream's list."""
        listing = await self.models()
        if listing.status_code >= 400:
            return listing
        try:
            cards = orjson.loads(bytes(listing.body))["data"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise TransportError("upstream's model list is not an OpenAI model list") from None
        for card in cards if isinstance(cards, list) else ():
            if isinstance(card, dict) and card.get("id") == model_id:
                return Response(orjson.dumps(card), media_type="application/json")
        raise ModelNotFoundError(f"the model '{model_id}' does not exist upstream")

    async def _post_upstream(self, body: bytes) -> tuple[int, str, bytes]:
        try:
            async with self.session.post(
                self._completions_url, data=body, headers=self._upstream_headers
            ) as resp:
                return resp.status, resp.content_type, await resp.read()
        except _UPSTREAM_ERRORS as exc:
            raise self._unreachable(exc) from None

    def _unreachable(self, exc: BaseException) -> TransportError:
        return TransportError(
            f"upstream {self.settings.upstream_url} unreachable: {type(exc).__name__}: {exc}"
        )

    def _upstream_refusal(self, status: int, content_type: str, raw: bytes) -> Response:
        if status >= 500:
            text = raw[:200].decode(errors="replace")
            raise TransportError(f"upstream answered HTTP {status}: {text}")
        return Response(raw, status_code=status, media_type=content_type)

    def _record_reply(
        self, tag: EpisodeTag, payload: dict[str, Any], raw: bytes, version: int, latency: float
    ) -> None:
        try:
            reply = orjson.loads(raw)
            choice = reply["choices"][0]
            message = _clean_message(choice["message"])
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
            raise TransportError("upstream reply is not an OpenAI chat completion") from None
        # Malformed token data raises here: the call fails whole and nothing is filed.
        read = self._adapter.read(reply)
        self._record(
            tag,
            payload,
            message,
            choice.get("finish_reason"),
            reply.get("usage"),
            version=version,
            latency=latency,
            streamed=False,
            logprobs=choice.get("logprobs"),
            read=read,
            completion_id=reply.get("id"),
        )

    def _record(
        self,
        tag: EpisodeTag,
        payload: dict[str, Any],
        message: dict[str, Any],
        finish: Any,
        usage: Any,
        *,
        version: int,
        latency: float,
        streamed: bool,
        logprobs: Any = None,
        read: EngineTokens | None = None,
        completion_id: Any = None,
        segments: list[TokenSegment] | None = None,
        continued_tokens: int = 0,
        regenerated: str | None = None,
    ) -> None:
        # Neither content nor tool calls: the call failed (502 to a plain caller, which
        # re-sends the row), and nothing is filed.
        check_said(message, f"upstream {self.settings.upstream_url}")
        messages = payload["messages"]
        trace = None
        if read is not None:
            trace = TokenTrace.build(
                engine=self._adapter.name,
                completion_ids=read.completion_ids,
                completion_logprobs=read.logprobs,
                prompt_ids=read.prompt_ids,
                context=self.ledger.context_before(tag.rollout_id, tag.turn),
            )
            if read.logprobs is not None:
                logprobs = None  # the trace holds them, packed
        last = messages[-1] if messages and isinstance(messages[-1], dict) else None
        prompt, completion = _usage_tokens(usage)
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        # model_construct: the data is ours or the engine's, already parsed; validation
        # happens where records come back from disk (CallLedger.install).
        self.ledger.record(
            CallRecord.model_construct(
                rollout_id=tag.rollout_id,
                attempt=tag.attempt,
                turn=tag.turn,
                request_messages=len(messages),
                last_message=last,
                response=message,
                finish_reason=finish if isinstance(finish, str) else None,
                prompt_tokens=prompt,
                completion_tokens=completion,
                policy_version=version,
                latency_s=latency,
                streamed=streamed,
                logprobs=logprobs,
                completion_id=completion_id if isinstance(completion_id, str) else None,
                tokens=trace,
                segments=segments,
                continued_tokens=continued_tokens,
                regenerated=regenerated,
            )
        )

    async def _stream(
        self,
        body: bytes,
        payload: dict[str, Any],
        tag: EpisodeTag | None,
        regenerated: str | None = None,
    ) -> Response:
        stack = AsyncExitStack()
        await stack.enter_async_context(self.gate.admit())
        try:
            self._guard(tag)
        except BaseException:
            await stack.aclose()
            raise
        stack.enter_context(self.running.track(tag))
        version = self.policy_version
        started = time.perf_counter()
        try:
            resp = await stack.enter_async_context(
                self.session.post(self._completions_url, data=body, headers=self._upstream_headers)
            )
            refusal = None
            if resp.status >= 400:
                refusal = (resp.status, resp.content_type, await resp.read())
        except _UPSTREAM_ERRORS as exc:
            await stack.aclose()
            raise self._unreachable(exc) from None
        except BaseException:
            await stack.aclose()
            raise
        if refusal is not None:
            await stack.aclose()
            self.calls_total += 1
            return self._upstream_refusal(*refusal)

        partial = None
        if self.settings.cut_generations and tag is not None:
            partial = PartialCall(
                tag.rollout_id, tag.attempt, tag.turn, version, request=request_digest(body)
            )

        async def relay() -> AsyncIterator[bytes]:
            assembler = (
                StreamAssembler(self._adapter.stream(), partial, self._adapter.name)
                if tag is not None
                else None
            )
            if partial is not None:
                self.partials[id(partial)] = partial
            try:
                async for chunk in resp.content.iter_any():
                    if assembler is not None:
                        assembler.feed(chunk)
                    yield chunk
            except _UPSTREAM_ERRORS as exc:
                log.warning("upstream stream broke: %s: %s", type(exc).__name__, exc)
                return
            except TransportError as exc:
                # A malformed chunk, not relayed: the caller's stream ends short (a
                # transport failure it retries) and the call is not filed.
                log.warning("upstream stream refused: %s", exc.message)
                return
            finally:
                if partial is not None:
                    self.partials.pop(id(partial), None)
            self.calls_total += 1
            self.call_seconds.observe(time.perf_counter() - started)
            if assembler is not None and tag is not None and not self._retired(tag):
                try:
                    assembler.check_finished(self.settings.upstream_url)
                    read = assembler.tokens.result() if assembler.tokens is not None else None
                    # The bytes are relayed already; the call is just not filed (never half).
                    self._record(
                        tag,
                        payload,
                        assembler.message(),
                        assembler.finish_reason,
                        assembler.usage,
                        version=version,
                        latency=time.perf_counter() - started,
                        streamed=True,
                        read=read,
                        completion_id=assembler.completion_id,
                        # Spanned a weight update (keep): the headers left before it did.
                        segments=_spanning(partial),
                        regenerated=regenerated,
                    )
                except TransportError as exc:
                    log.warning("stream of %s not recorded: %s", tag.rollout_id, exc.message)

        return _HeldStream(
            relay(),
            stack,
            media_type=resp.headers.get("content-type", "text/event-stream"),
            headers={HEADER_POLICY_VERSION: str(version), "cache-control": "no-cache"},
        )

    def _retired(self, tag: EpisodeTag) -> bool:
        try:
            self._guard(tag)
        except StaleAttemptError:
            return True
        return False


def _spanning(partial: PartialCall | None) -> list[TokenSegment] | None:
    """The segments of a call that spanned a weight update; None for one of one version."""
    if partial is None:
        return None
    segments = partial.segments()
    return segments if len(segments) > 1 else None


def _plain_aborted(status: int, raw: bytes) -> bool:
    """Whether a plain reply is the engine's abort of the call (finish reason ``abort``)."""
    if status != 200 or b'"abort"' not in raw:
        return False
    try:
        choices = orjson.loads(raw)["choices"]
        return any(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices)
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False


def model_server_of(app: FastAPI) -> ModelServer:
    """The :class:`ModelServer` behind an app built by :func:`create_model_app`."""
    server: ModelServer = app.state.model_server
    return server


def create_model_app(settings: ModelServerSettings) -> FastAPI:
    """The model server of one replica; with ``settings.snapshot_root``, a participant too."""
    server = ModelServer(settings)

    async def start(app: FastAPI) -> None:
        await server.start()
        server.journal = await open_call_journal(server)

    async def stop(app: FastAPI) -> None:
        await server.stop()
        if server.journal is not None:
            await server.journal.close()

    app, fence = create_server_app(
        f"rollpoint model server {settings.name}/{settings.replica}",
        metrics=server.metrics,
        participant=lambda: ModelParticipant(server),
        control=control_plane(
            settings.snapshot_root, settings.lease_grace_s, settings.clock_skew_s
        ),
        start=start,
        stop=stop,
    )
    app.state.model_server = server
    if fence is not None:
        server.attempt_guard = fence.check_attempt

    async def chat_completions(request: Request) -> Response:
        if server.journal is not None:
            return await server.journal.serve(request, server.chat_completions)
        return await server.chat_completions(request)

    # A Starlette route, not a FastAPI one: it reads the raw body and answers raw bytes,
    # so FastAPI's request handler (dependencies, exit stack, response checks) was pure
    # cost on every policy call. Errors still get the envelope (the app's handlers) and
    # the data token still guards it (a middleware); it is left out of /openapi.json.
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        return await server.models()

    # :path: model ids may hold slashes ("org/name").
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return await server.model(model_id)

    @app.get("/rollpoint/v1/calls")
    async def calls(rollout_id: Annotated[str, Query(min_length=1)]) -> dict[str, Any]:
        records = server.ledger.export([rollout_id])
        return {"rollout_id": rollout_id, "calls": records}

    @app.post("/rollpoint/v1/policy_version")
    async def policy_version(req: PolicyVersionRequest) -> dict[str, int]:
        server.policy_version = req.version
        return {"policy_version": server.policy_version}

    @app.get("/rollpoint/v1/stats")
    async def stats() -> dict[str, Any]:
        return server.stats()

    @app.post("/rollpoint/v1/weights/pause")
    async def weights_pause(req: PauseRequest) -> dict[str, Any]:
        return await server.weights.pause(req.mode)

    @app.post("/rollpoint/v1/weights/live")
    async def weights_live(req: LiveRequest) -> dict[str, Any]:
        return await server.weights.live(req.version)

    return app
