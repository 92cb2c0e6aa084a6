"""The resources server: the HTTP face of one replica's episodes.

Owns :func:`create_resources_app` (the app of one replica: its
:class:`~rollpoint.servers.resources.episode_service.ResourcesService`, its metrics, the
tool journal opened at start, and what is closed at stop) and the routes below. The
episodes, their idempotency and their freeze are the service's
(:mod:`~rollpoint.servers.resources.episode_service`); the checkpoint control routes are
mounted when a snapshot root is given, and drive the service through
:class:`~rollpoint.servers.resources.resources_participant.ResourcesParticipant`.

Routes (see ``docs/architecture.md``):

- ``GET /tools`` → :class:`ToolsReply`
- ``POST /episodes/start`` :class:`EpisodeStart` → :class:`StartReply` (idempotent per rollout)
- ``POST /tools/{name}`` :class:`ToolCall` → :class:`ToolResult`; a bad call is a tool
  error for the model, never a 5xx; a known key with the same call (tool and arguments,
  :func:`~rollpoint.servers.resources.episode_record.call_fingerprint`) replays the first result, with
  another call it is 409 ``idempotency_conflict`` naming the key and runs nothing; unknown
  episode → 404 ``not_found``; an exception in the environment's own code (a tool, ``start``,
  ``verify``, ``export_state``) → 500 ``environment_error`` naming it, its traceback in this
  server's log (:mod:`~rollpoint.servers.resources.environment_calls`)
- ``POST /episodes/verify`` :class:`VerifyRequest` → :class:`VerifyReply`
- ``POST /episodes/release`` :class:`ReleaseRequest` → :class:`ReleaseReply`
- ``GET /metrics``: tool calls applied, idempotent replays, 409 refusals of starts and tool
  calls by code (``rollpoint_resources_conflicts_total``), live episodes, calls in flight
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI
from pydantic import Field, JsonValue

from rollpoint.envs.base import Environment
from rollpoint.envs.registry import get_environment
from rollpoint.http.server_metrics import ServerMetrics
from rollpoint.protocol.episode import (
    EpisodeStart,
    ToolCall,
    ToolResult,
    VerifyReply,
    VerifyRequest,
)
from rollpoint.protocol.ids import Identifier
from rollpoint.protocol.model_base import StrictModel
from rollpoint.servers.resources.episode_service import ResourcesService
from rollpoint.servers.resources.final_state_log import FinalStateLog
from rollpoint.servers.resources.resources_participant import ResourcesParticipant
from rollpoint.servers.resources.tool_journal import (
    ToolJournal,
    check_effect_store,
    open_tool_journal,
)
from rollpoint.servers.server_app import control_plane, create_server_app

# ResourcesService moved to episode_service; importers of this module keep working.
__all__ = [
    "ReleaseReply",
    "ReleaseRequest",
    "ResourcesService",
    "StartReply",
    "ToolsReply",
    "create_resources_app",
    "resources_service",
]


# ---- wire models ---------------------------------------------------------------------------
class ToolsReply(StrictModel):
    environment: str
    tools: list[dict[str, JsonValue]]
    """OpenAI function-tool specs."""


class StartReply(StrictModel):
    created: bool
    """False when the rollout already had state (a continued attempt finds it)."""


class ReleaseRequest(StrictModel):
    rollout_ids: Annotated[list[Identifier], Field(max_length=100_000)]


class ReleaseReply(StrictModel):
    released: int
    """How many of the named rollouts had state; unknown ids are not an error."""


# ---- routes --------------------------------------------------------------------------------
def create_resources_app(
    environment: str | Environment[Any],
    *,
    name: str = "resources",
    replica: str = "replica-0",
    snapshot_root: str | None = None,
    lease_grace_s: float = 2.0,
    final_states_dir: Path | None = None,
    clock_skew_s: float = 0.0,
    journal: bool = False,
    journal_window_s: float = 0.002,
) -> FastAPI:
    """The resources server of one replica; its service is ``app.state.resources_service``.

    With ``snapshot_root`` (a local path or fsspec URL) it is a checkpoint participant
    too: the control routes are mounted, guarded by ``ROLLPOINT_CONTROL_TOKEN``. With
    ``final_states_dir`` every verified episode's state is logged there
    (:mod:`~rollpoint.servers.resources.final_state_log`). ``clock_skew_s``: fault
    injection, as :func:`~rollpoint.participant.mount_participant` says. With ``journal``,
    every applied tool call is journaled in the snapshot store (a local ``snapshot_root``)
    and a restored episode's calls are answered from it
    (:mod:`~rollpoint.servers.resources.tool_journal`).
    """
    env = get_environment(environment) if isinstance(environment, str) else environment
    final_states = None if final_states_dir is None else FinalStateLog(final_states_dir, replica)
    service = ResourcesService(env, name=name, replica=replica, final_states=final_states)
    if env.effects and snapshot_root is not None:
        # Refused now, before the server starts, when the store cannot hold them; kept
        # whether or not journal.enabled is on (effect_records says why).
        service.effect_store = check_effect_store(service, snapshot_root)

    metrics = ServerMetrics(server=name, replica=replica)
    metrics.read(service.readings)

    async def start(app: FastAPI) -> None:
        if journal:
            app.state.tool_journal = service.tool_journal = await open_tool_journal(
                service, snapshot_root, window_s=journal_window_s
            )

    async def stop(app: FastAPI) -> None:
        service.tools.close()
        if final_states is not None:
            final_states.close()
        if journal:
            await app.state.tool_journal.close()

    app, fence = create_server_app(
        f"rollpoint {name} ({replica}, {env.name})",
        metrics=metrics,
        participant=lambda: ResourcesParticipant(service),
        control=control_plane(snapshot_root, lease_grace_s, clock_skew_s),
        start=start,
        stop=stop,
    )
    app.state.resources_service = service
    if fence is not None:
        service.attempt_guard = fence.check_attempt
    tools = ToolsReply(environment=env.name, tools=env.tools())

    @app.get("/tools")
    async def list_tools() -> ToolsReply:
        return tools

    @app.post("/episodes/start")
    async def start_episode(body: EpisodeStart) -> StartReply:
        with service.counting_conflicts():
            created = await service.start(body)
            if service.tool_journal is not None:
                # An earlier process's journaled calls of the rollout: the agent resumes
                # the episode after them, so its state must be there too.
                await service.tool_journal.catch_up(body.episode)
            service.check_held(body)
            return StartReply(created=created)

    @app.post("/tools/{name}")
    async def call_tool(name: str, body: ToolCall) -> ToolResult:
        with service.counting_conflicts():
            if journal:
                tool_journal: ToolJournal = app.state.tool_journal
                return await tool_journal.call_tool(name, body)
            return await service.call_tool(name, body)

    @app.post("/episodes/verify")
    async def verify_episode(body: VerifyRequest) -> VerifyReply:
        return service.verify(body)

    @app.post("/episodes/release")
    async def release_episodes(body: ReleaseRequest) -> ReleaseReply:
        return ReleaseReply(released=await service.release_when_thawed(body.rollout_ids))

    return app


def resources_service(app: FastAPI) -> ResourcesService:
    """The service behind an app made by :func:`create_resources_app`."""
    service = app.state.resources_service
    if not isinstance(service, ResourcesService):
        raise TypeError("this app was not made by create_resources_app")
    return service
