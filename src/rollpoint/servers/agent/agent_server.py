"""The agent server: ``POST /run`` plays task rows as episodes and streams their results.

Owns: the HTTP face of one :class:`~rollpoint.servers.agent.session_book.SessionBook` and its
:class:`~rollpoint.servers.agent.episode_runner.EpisodeRunner` (one aiohttp client per app, made at
startup, closed at shutdown, when running sessions are cancelled too). Routes:

- ``POST /run`` :class:`RunRequest` → ``application/x-ndjson``: one :class:`RowResult` line
  per row, in the order rows finish. Rows run as tasks of the book, not of the request: a
  client that goes away cancels nothing, and a failed row never ends its siblings.
- ``GET /rollpoint/v1/sessions`` → session counts by state, boundaries, readiness.
- ``GET /metrics`` → the same counts for Prometheus (``rollpoint_agent_sessions{state}``).
- ``GET /rollpoint/v1/journal`` → ``{"rollouts": [...]}``: the rollouts an earlier process
  journaled turns of here (:mod:`.turn_journal`), which a restored trainer sends back here.
- ``POST /rollpoint/v1/ack`` ``{"episodes": [EpisodeId]}`` → ``{"acked": [...]}``: releases
  finished replies (the book's :meth:`~SessionBook.ack` is the one implementation; the
  control plane's ``ack`` verb calls the same method and is the official one).

With ``snapshot_root`` set, the checkpoint control routes are mounted too, driving the book
through :class:`~rollpoint.servers.agent.agent_participant.AgentParticipant`.

Does not own: checkpoint control (the fence drives the book), the episode loop (the runner).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import orjson
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, JsonValue

from rollpoint.agent_loops import resolve_agent_loop
from rollpoint.http.auth import data_token
from rollpoint.http.client import HttpClient
from rollpoint.http.server_metrics import Reading, ServerMetrics
from rollpoint.protocol.control import MAX_BATCH
from rollpoint.protocol.episode import EnvironmentName, RowResult, RunReply, RunRequest
from rollpoint.protocol.errors import TransportError
from rollpoint.protocol.ids import EpisodeId, Identifier
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import CheckpointMode
from rollpoint.servers.agent.agent_participant import AgentParticipant
from rollpoint.servers.agent.episode_runner import EpisodeRunner
from rollpoint.servers.agent.play_contract import TurnBoundary
from rollpoint.servers.agent.session import LIVE_STATES, Session, SessionState
from rollpoint.servers.agent.session_book import SessionBook
from rollpoint.servers.agent.turn_journal import open_turn_journal
from rollpoint.servers.server_app import control_plane, create_server_app

NDJSON = "application/x-ndjson"


class AgentSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_url: str
    """Base URL of the model server (no ``/v1``)."""
    resources_url: str
    environment: EnvironmentName
    name: Identifier = "agent"
    replica: Identifier = "replica-0"
    checkpoint_mode: CheckpointMode = CheckpointMode.TURN
    max_finished_replies: Annotated[int, Field(ge=1)] = 10_000
    """Finished replies held until acked; past it the oldest are dropped (logged)."""
    model_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    tool_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    upstream_connections: Annotated[int, Field(ge=1)] | None = None
    """Most connections open to the model server, and to the resources server; calls
    beyond wait here for one, and only their time on the wire counts against the
    timeouts. None: no cap."""
    model_name: str = "scripted"
    sampling: dict[str, JsonValue] = {}
    """Fields every policy call carries (temperature, top_p, engine extras, ...)."""
    seed_policy: Literal["episode", "turn", "none"] = "episode"
    capture_tokens: bool = False
    """Ask the engine for token ids and logprobs and keep them with each model call."""
    engine: str = "vllm"
    """The reply shape token data is read from (an engine adapter's name)."""
    agent_loop: str | None = None
    """A custom agent loop by import path (``rollpoint.agent_loops``); None: the built-in one."""
    snapshot_root: str | None = None
    """Snapshot store root (local path or fsspec URL); set, it mounts the control routes
    (token from ``ROLLPOINT_CONTROL_TOKEN``). None: a plain data server."""
    lease_grace_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 2.0
    """A checkpoint's lease lapses this long after its deadline, then boundaries reopen."""
    clock_skew_s: Annotated[float, Field(allow_inf_nan=False)] = 0.0
    """Fault injection: the control clock runs this far ahead (``rollpoint chaos``)."""
    journal: bool = False
    """Journal each completed turn and finished reply in the snapshot store, and resume
    what an earlier process left unfinished from it (:mod:`.turn_journal`); needs a local
    ``snapshot_root``."""
    journal_window_s: Annotated[float, Field(ge=0, le=1)] = 0.002
    """The journal's group-commit window."""


class AckEpisodes(StrictModel):
    episodes: Annotated[list[EpisodeId], Field(max_length=MAX_BATCH)]


class AgentServer:
    """The state behind one agent app: the book, and the runner once started."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.book = SessionBook(
            self._play,
            environment=settings.environment,
            mode=settings.checkpoint_mode,
            max_finished_replies=settings.max_finished_replies,
        )
        self._client: HttpClient | None = None
        self._runner: EpisodeRunner | None = None

    async def start(self) -> None:
        s = self.settings
        # Its model and resources servers guard their data routes with the same token.
        self._client = HttpClient(
            token=data_token(),
            timeout_s=max(s.model_timeout_s, s.tool_timeout_s),
            limit_per_host=s.upstream_connections or 0,
        )
        self._runner = EpisodeRunner(
            self._client,
            model_url=s.model_url,
            resources_url=s.resources_url,
            environment=s.environment,
            model_name=s.model_name,
            model_timeout_s=s.model_timeout_s,
            tool_timeout_s=s.tool_timeout_s,
            sampling=s.sampling,
            seed_policy=s.seed_policy,
            engine=s.engine if s.capture_tokens else None,
            loop=None if s.agent_loop is None else resolve_agent_loop(s.agent_loop)(),
        )

    async def stop(self) -> None:
        await self.book.aclose()
        if self._runner is not None:
            await self._runner.aclose()
            self._runner = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _play(self, session: Session, boundary: TurnBoundary) -> RunReply:
        if self._runner is None:
            raise TransportError("agent server is not started")
        return await self._runner.play(session, boundary)

    def readings(self) -> list[Reading]:
        """What ``/metrics`` shows, read at each scrape."""
        counts = self.book.counts()
        doc = "Live sessions by state"
        out = [
            Reading("rollpoint_agent_sessions", doc, counts.get(str(s), 0), labels={"state": s})
            for s in SessionState
            if s in LIVE_STATES
        ]
        out += [
            Reading(
                "rollpoint_agent_replies_unacked",
                "Finished replies kept until the trainer acks them",
                counts.get("finished_unacked", 0),
            ),
            Reading(
                "rollpoint_agent_retired_rollouts",
                "Rollouts with a retire mark",
                counts.get("retired_rollouts", 0),
            ),
            Reading(
                "rollpoint_agent_boundaries_open",
                "1 while sessions may leave their turn boundaries",
                int(self.book.boundaries_open),
            ),
        ]
        return out

    def sessions(self) -> dict[str, Any]:
        readiness = self.book.readiness()
        return {
            "name": self.settings.name,
            "replica": self.settings.replica,
            "counts": self.book.counts(),
            "boundaries_open": self.book.boundaries_open,
            "ready": readiness.ready,
            "blocker_count": readiness.blocker_count,
        }


async def _ndjson(results: list[asyncio.Future[RowResult]]) -> AsyncIterator[bytes]:
    # Done callbacks, not awaits: a client that goes away cancels this generator, and an
    # awaited shared future would be cancelled with it (and with it every joiner's result).
    finished: asyncio.Queue[RowResult] = asyncio.Queue()
    for future in results:
        future.add_done_callback(lambda f: finished.put_nowait(f.result()))
    for _ in results:
        result = await finished.get()
        yield orjson.dumps(result.model_dump(mode="json")) + b"\n"


def agent_server_of(app: FastAPI) -> AgentServer:
    """The :class:`AgentServer` behind an app built by :func:`create_agent_app`."""
    server: AgentServer = app.state.agent_server
    return server


def create_agent_app(settings: AgentSettings) -> FastAPI:
    """The agent server of one replica; with ``settings.snapshot_root``, a participant too."""
    server = AgentServer(settings)
    metrics = ServerMetrics(server=settings.name, replica=settings.replica)
    metrics.read(server.readings)

    async def start(app: FastAPI) -> None:
        await server.start()
        if settings.journal:
            server.book.journal = await open_turn_journal(
                settings.snapshot_root,
                settings.name,
                settings.replica,
                window_s=settings.journal_window_s,
            )

    async def stop(app: FastAPI) -> None:
        await server.stop()
        if server.book.journal is not None:
            await server.book.journal.close()

    app, fence = create_server_app(
        f"rollpoint agent server {settings.name}/{settings.replica}",
        metrics=metrics,
        participant=lambda: AgentParticipant(server),
        control=control_plane(
            settings.snapshot_root, settings.lease_grace_s, settings.clock_skew_s
        ),
        start=start,
        stop=stop,
    )
    app.state.agent_server = server
    if fence is not None:
        # One copy of the retire marks: the fence writes them, /run admission reads them.
        server.book.marks = fence.marks

    @app.post("/run")
    async def run(request: RunRequest) -> StreamingResponse:
        results = [server.book.submit(row) for row in request.rows]
        return StreamingResponse(_ndjson(results), media_type=NDJSON)

    @app.get("/rollpoint/v1/sessions")
    async def sessions() -> dict[str, Any]:
        return server.sessions()

    @app.get("/rollpoint/v1/journal")
    async def journal() -> dict[str, Any]:
        """The rollouts whose turns an earlier process journaled here, not resumed yet: a
        restored trainer sends them back to this replica."""
        found = server.book.journal
        return {"rollouts": [] if found is None else found.rollouts()}

    @app.post("/rollpoint/v1/ack")
    async def ack(request: AckEpisodes) -> dict[str, Any]:
        acked = server.book.ack(request.episodes)
        return {"acked": [e.model_dump() for e in acked]}

    return app
