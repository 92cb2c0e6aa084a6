"""The app of a built-in server: one factory for the lifespan and the control plane they share.

Owns what the model, agent and resources servers' apps have in common: the FastAPI app
(:func:`rollpoint.http.app.create_app`, behind the data token), its lifespan (the server's
own start; on shutdown the control plane closed first, so no checkpoint verb reaches a
stopping server, then the server's own stop), its metrics mounted, and, with a snapshot
root, the participant mounted (:func:`rollpoint.participant.mount_participant`: the fence
and the control routes, guarded by the control token, also served by a control listener on
a thread, event loop and port of their own, so that data-plane load cannot delay them:
:mod:`rollpoint.participant.control_listener`).

It does not own a server's routes, what its start and stop do, nor what it saves (each
server's participant); nor the processes a server runs in (:mod:`rollpoint.runtime`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI

from rollpoint.http.app import create_app
from rollpoint.http.auth import data_token, load_token
from rollpoint.http.server_metrics import ServerMetrics
from rollpoint.participant import Fence, Participant, close_control_plane, mount_participant

__all__ = ["ControlPlane", "control_plane", "create_server_app"]


@dataclass(frozen=True)
class ControlPlane:
    """Where a server's participant saves, and its fence's lease and clock
    (:func:`~rollpoint.participant.mount_participant` says what each means)."""

    snapshot_root: str
    lease_grace_s: float = 2.0
    clock_skew_s: float = 0.0


def control_plane(
    snapshot_root: str | None, lease_grace_s: float, clock_skew_s: float
) -> ControlPlane | None:
    """The control plane of a server saving under ``snapshot_root``; None without one."""
    if snapshot_root is None:
        return None
    return ControlPlane(snapshot_root, lease_grace_s, clock_skew_s)


async def _nothing(app: FastAPI) -> None:
    return None


def create_server_app(
    title: str,
    *,
    metrics: ServerMetrics,
    participant: Callable[[], Participant],
    control: ControlPlane | None,
    start: Callable[[FastAPI], Awaitable[None]] = _nothing,
    stop: Callable[[FastAPI], Awaitable[None]] = _nothing,
) -> tuple[FastAPI, Fence | None]:
    """The app of one server replica and, with ``control``, the fence over the participant
    ``participant()`` makes (None without: the server takes no part in checkpoints).

    ``start`` runs when the app starts serving; ``stop`` when it shuts down, after the
    control plane is closed. The caller adds its routes to the app.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await start(app)
        try:
            yield
        finally:
            await close_control_plane(app)
            await stop(app)

    app = create_app(title, lifespan=lifespan, data_token=data_token())
    metrics.mount(app)
    fence = None
    if control is not None:
        fence = mount_participant(
            app,
            participant(),
            token=load_token(),
            snapshot_root=control.snapshot_root,
            lease_grace_s=control.lease_grace_s,
            clock_skew_s=control.clock_skew_s,
        )
    return app, fence
