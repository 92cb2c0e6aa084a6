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

Its parts, each in its module: the episode headers and the calls running
(:mod:`~rollpoint.servers.model.episode_tag`), the engine's HTTP
(:mod:`~rollpoint.servers.model.engine_upstream`), a stream's reply rebuilt
(:mod:`~rollpoint.servers.model.stream_assembler`), a call filed in the ledger
(:mod:`~rollpoint.servers.model.call_recorder`), a plain call under the generation cut
(:mod:`~rollpoint.servers.model.cut_calls`) and a streamed caller's relay
(:mod:`~rollpoint.servers.model.streamed_calls`); this module keeps the server's state and
counts, a call's way in and the plain path, and the app with its routes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import orjson
from fastapi import FastAPI, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from rollpoint.http.server_metrics import CALL_BUCKETS, Reading, ServerMetrics
from rollpoint.participant import AdmissionGate
from rollpoint.policy.engine_adapters import adapter_for
from rollpoint.protocol.errors import BadRequestError, TransportError
from rollpoint.protocol.ids import HEADER_POLICY_VERSION, EpisodeId, Identifier
from rollpoint.protocol.model_base import StrictModel
from rollpoint.servers.model.call_journal import CallJournal, open_call_journal
from rollpoint.servers.model.call_ledger import CallLedger
from rollpoint.servers.model.call_recorder import CallRecorder
from rollpoint.servers.model.cut_calls import CutCalls
from rollpoint.servers.model.engine_upstream import EngineUpstream
from rollpoint.servers.model.episode_tag import EpisodeTag, RunningCalls
from rollpoint.servers.model.generation_cut import (
    STREAMS_TOKEN_IDS,
    CallPrefix,
    CutCounts,
    FrozenPartial,
    PartialCall,
)
from rollpoint.servers.model.model_participant import ModelParticipant
from rollpoint.servers.model.stream_assembler import StreamAssembler
from rollpoint.servers.model.streamed_calls import StreamedCalls
from rollpoint.servers.model.weight_switch import LiveRequest, PauseRequest, WeightSwitch
from rollpoint.servers.server_app import control_plane, create_server_app

__all__ = [
    "MAX_ABORTS",
    "EpisodeTag",
    "ModelServer",
    "ModelServerSettings",
    "PolicyVersionRequest",
    "StreamAssembler",
    "create_model_app",
    "model_server_of",
]

log = logging.getLogger(__name__)

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
        self.recorder = CallRecorder(self.ledger, self._adapter, settings.upstream_url)
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
        self.upstream = EngineUpstream(settings, self._adapter.name)
        self.weights = WeightSwitch(self, can_split=lambda: self._cut)
        self.cut_calls = CutCalls(self, self._adapter)
        self.streamed = StreamedCalls(self, self._adapter)
        self.aborted_calls = 0
        """Calls the engine aborted for a weight update, sent again after it."""

    async def start(self) -> None:
        await self.upstream.start()

    async def stop(self) -> None:
        await self.upstream.stop()

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
                self.recorder.prompt_tokens,
                "counter",
                {"kind": "prompt"},
            ),
            Reading(
                "rollpoint_model_tokens",
                "Tokens of recorded calls, by kind",
                self.recorder.completion_tokens,
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

    async def chat_completions(self, request: Request) -> Response:
        body = await request.body()
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise BadRequestError("request body is not valid JSON") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
            raise BadRequestError("request body must be a JSON object with a 'messages' list")
        tag = EpisodeTag.from_headers(request.headers)
        self.guard(tag)
        if not self.weights.is_live:
            await self.weights.wait_live()  # it starts under the new weights
        cut = self._cut
        if payload.get("stream") is True:
            # A streamed caller is relayed as it comes: its saved prefix is not continued.
            regenerated = None
            if cut and tag is not None and self.cut_calls.take_prefix(tag) is not None:
                regenerated = "streamed_caller"
                self.cut_calls.refused(tag, regenerated)
            return await self.streamed.call(body, payload, tag, regenerated)
        if cut and tag is not None:
            if payload.get("n", 1) in (1, None):
                return await self.cut_calls.call(body, payload, tag)
            if self.cut_calls.take_prefix(tag) is not None:
                self.cut_calls.refused(tag, "choices")
        async with self.gate.admit():
            # Again: the attempt may have been retired while the call waited at the gate.
            self.guard(tag)
            with self.running.track(tag):
                aborts = 0
                while True:
                    version = self.policy_version
                    started = time.perf_counter()
                    status, content_type, raw = await self.upstream.post(body)
                    latency = time.perf_counter() - started
                    # Only once a weight update was ever asked for: no scan on other calls.
                    if not (self.weights.touched and _plain_aborted(status, raw)):
                        break
                    aborts += 1
                    await self.after_abort(tag, aborts)
        self.calls_total += 1
        self.call_seconds.observe(latency)
        if status >= 400:
            return self.upstream.refusal(status, content_type, raw)
        if tag is not None:
            # Retired while it ran: its caller was stopped, so the reply is refused, not filed.
            self.guard(tag)
            self.recorder.record_reply(tag, payload, raw, version, latency)
        return Response(raw, media_type=content_type, headers={HEADER_POLICY_VERSION: str(version)})

    async def after_abort(self, tag: EpisodeTag | None, aborts: int) -> None:
        """The engine aborted the call for a weight update: send it again once it is over
        (a call aborted :data:`MAX_ABORTS` times fails, as a transport error)."""
        if aborts > MAX_ABORTS:
            raise TransportError(
                f"upstream {self.settings.upstream_url} aborted the call {aborts} times"
            )
        self.aborted_calls += 1
        log.info("call aborted for a weight update; sent again once the weights are live")
        await self.weights.wait_live()
        self.guard(tag)

    def guard(self, tag: EpisodeTag | None) -> None:
        """Raise :class:`StaleAttemptError` when ``tag`` names a retired attempt."""
        if tag is not None and self.attempt_guard is not None:
            self.attempt_guard(tag.episode)


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
        return await server.upstream.models()

    # :path: model ids may hold slashes ("org/name").
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return await server.upstream.model(model_id)

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
