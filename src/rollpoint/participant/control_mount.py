"""Switching a server's checkpoint control plane on: token, fence and routes, in one place.

Owns the switch every participant uses, the built-in model, agent and resources servers
included. :func:`mount_participant` takes the control token as an argument (this package
reads nothing from the environment: the built-in servers load theirs from
``ROLLPOINT_CONTROL_TOKEN`` when their app is made, and pass it; an empty one is a
:class:`~rollpoint.protocol.errors.ConfigError`, so a server never starts with unguarded
control routes), builds the :class:`~rollpoint.participant.fence.Fence` over the server's
participant, mounts the control routes and keeps the fence on ``app.state.fence``.
:func:`close_control_plane` stops the fence when the app shuts down.

With a ``control_host`` (the default: loopback) it also serves the control routes on a
listener of their own (:class:`~rollpoint.participant.control_listener.ControlListener`:
its own thread, event loop and port, reported by status), started by the app's lifespan
once the app's own start is done and stopped before its own stop, so a third-party
participant gets a control plane that data-plane load cannot delay, as the built-in
servers do. The routes stay on the app too, at the server's URL.

Does not own the phase machine (:mod:`rollpoint.participant.fence`), the routes
(:mod:`rollpoint.participant.control_routes`) nor any server's state (its participant).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from rollpoint.participant.control_listener import ControlListener
from rollpoint.participant.control_routes import mount_control_routes
from rollpoint.participant.control_settings import ControlSettings
from rollpoint.participant.fence import Fence
from rollpoint.participant.participant import Participant
from rollpoint.protocol.errors import ConfigError

__all__ = ["close_control_plane", "control_fence", "control_listener", "mount_participant"]


def mount_participant(
    app: FastAPI,
    participant: Participant,
    *,
    token: str,
    snapshot_root: str,
    lease_grace_s: float = 2.0,
    clock_skew_s: float = 0.0,
    control_host: str | None = "127.0.0.1",
) -> Fence:
    """Make ``app`` a checkpoint participant: a fence over ``participant`` and the control
    routes, guarded by ``token`` (passed explicitly: nothing is read from the environment).

    The SDK's one mounting function (``rollpoint.participant``), the built-in servers'
    too. Returns the fence (also on ``app.state.fence``); close it with
    :func:`close_control_plane` when the app shuts down. ``clock_skew_s`` is for fault
    injection: the fence reads deadlines and leases against a clock that far ahead of this
    machine's (behind when negative), as a participant on a skewed machine would.
    ``control_host``: where the control listener binds (port: a free one), the host of the
    server's own URL (a client reaches it there); None: no listener, the control routes
    are served on the app's loop only.
    """
    settings = ControlSettings(
        token=token, snapshot_root=snapshot_root, lease_grace_s=lease_grace_s
    )
    if not math.isfinite(clock_skew_s):
        raise ConfigError(f"clock_skew_s must be a finite number of seconds, got {clock_skew_s}")
    clock = time.time if clock_skew_s == 0 else (lambda: time.time() + clock_skew_s)
    fence = Fence(participant, settings, clock=clock)
    mount_control_routes(app, fence, settings)
    app.state.fence = fence
    if control_host is not None:
        listener = ControlListener(fence, settings, host=control_host)
        app.state.control_listener = listener
        _serve_alongside(app, listener)
    return fence


def _serve_alongside(app: FastAPI, listener: ControlListener) -> None:
    """Wrap the app's lifespan: the listener starts once the app's own start is done (on
    the loop that serves the app) and stops before its own stop begins."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(served: Any) -> AsyncIterator[Any]:
        async with inner(served) as state:
            listener.start()
            try:
                yield state
            finally:
                await listener.aclose()

    app.router.lifespan_context = lifespan


def control_listener(app: FastAPI) -> ControlListener | None:
    """The control listener :func:`mount_participant` set up on ``app``, if any (set its
    ``host`` before the app starts to bind it elsewhere)."""
    listener = getattr(app.state, "control_listener", None)
    return listener if isinstance(listener, ControlListener) else None


def control_fence(app: FastAPI) -> Fence | None:
    """The fence mounted on ``app`` by :func:`mount_participant`, if any."""
    fence = getattr(app.state, "fence", None)
    return fence if isinstance(fence, Fence) else None


async def close_control_plane(app: FastAPI) -> None:
    """Stop the control listener, then the fence's lease task (the app is shutting down);
    a no-op when off."""
    listener = control_listener(app)
    if listener is not None:
        await listener.aclose()
    fence = control_fence(app)
    if fence is not None:
        await fence.aclose()
