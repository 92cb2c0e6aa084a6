"""Switching a server's checkpoint control plane on: token, fence and routes, in one place.

Owns the switch the model, agent and resources servers share. With a snapshot root
configured, :func:`mount_control_plane` loads the control token (no default token exists:
a missing one is a :class:`~rollpoint.protocol.errors.ConfigError` at app creation, so a
server never starts with unguarded control routes), builds the
:class:`~rollpoint.gym.fence.Fence` over the server's participant, mounts the control
routes and keeps the fence on ``app.state.fence``. Without a snapshot root it mounts
nothing and the server is a plain data server. :func:`close_control_plane` stops the
fence when the app shuts down.

Does not own the phase machine (:mod:`rollpoint.gym.fence`), the routes
(:mod:`rollpoint.gym.control_routes`) nor any server's state (its participant).
"""

from __future__ import annotations

from fastapi import FastAPI

from rollpoint.gym.control_routes import mount_control_routes
from rollpoint.gym.fence import ControlSettings, Fence
from rollpoint.gym.participant import Participant
from rollpoint.http.auth import load_token

__all__ = ["close_control_plane", "control_fence", "mount_control_plane", "mount_participant"]


def mount_control_plane(
    app: FastAPI,
    participant: Participant,
    *,
    snapshot_root: str | None,
    lease_grace_s: float,
) -> Fence | None:
    """Mount the control routes of ``participant`` on ``app`` when ``snapshot_root`` is set.

    Returns the fence (also on ``app.state.fence``), or None when the control plane is off.
    """
    app.state.fence = None
    if snapshot_root is None:
        return None
    return mount_participant(
        app,
        participant,
        token=load_token(),
        snapshot_root=snapshot_root,
        lease_grace_s=lease_grace_s,
    )


def mount_participant(
    app: FastAPI,
    participant: Participant,
    *,
    token: str,
    snapshot_root: str,
    lease_grace_s: float = 2.0,
) -> Fence:
    """Make ``app`` a checkpoint participant: a fence over ``participant`` and the control
    routes, guarded by ``token`` (passed explicitly: nothing is read from the environment).

    The SDK's one mounting function (``rollpoint.participant``); the built-in servers reach
    it through :func:`mount_control_plane`, which reads their token from the environment.
    Returns the fence (also on ``app.state.fence``); close it with
    :func:`close_control_plane` when the app shuts down.
    """
    settings = ControlSettings(
        token=token, snapshot_root=snapshot_root, lease_grace_s=lease_grace_s
    )
    fence = Fence(participant, settings)
    mount_control_routes(app, fence, settings)
    app.state.fence = fence
    return fence


def control_fence(app: FastAPI) -> Fence | None:
    """The fence mounted on ``app`` by :func:`mount_control_plane`, if any."""
    fence = getattr(app.state, "fence", None)
    return fence if isinstance(fence, Fence) else None


async def close_control_plane(app: FastAPI) -> None:
    """Stop the fence's lease task (the app is shutting down); a no-op when off."""
    fence = control_fence(app)
    if fence is not None:
        await fence.aclose()
