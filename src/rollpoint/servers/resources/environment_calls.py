"""Calls into an environment's own code, and what an exception there becomes.

Owns :func:`environment_call`: around a tool, ``start``, ``verify``, ``export_state`` or
``capture_state``, an exception the environment did not raise on purpose (anything but a
:class:`~rollpoint.protocol.errors.RollpointError`, which passes as it is) is logged with
its traceback in this server's log and raised again as one
:class:`~rollpoint.protocol.errors.EnvironmentRaisedError`: a 500 ``environment_error``
whose message names the environment, the call, the exception's type and text, and the
environment's own frame where it was raised. On the wire it is typed and not retryable,
so the agent fails the row with that one line and the trainer fails its group instead of
re-sending it as if the network had dropped it (the same call would raise again).
"""

from __future__ import annotations

import inspect
import logging
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rollpoint.envs.base import Environment
from rollpoint.protocol.errors import EnvironmentRaisedError, RollpointError

log = logging.getLogger(__name__)

MESSAGE_CHARS = 300
"""The exception's text is clipped to this in the one line (the log has all of it)."""


@contextmanager
def environment_call(environment: Environment[Any], what: str, rollout_id: str) -> Iterator[None]:
    """Run the body as ``environment``'s ``what`` (``tool 'deposit'``, ``start``…) for
    ``rollout_id``; an exception of the environment's becomes :class:`EnvironmentRaisedError`."""
    try:
        yield
    except RollpointError:
        raise
    except Exception as exc:
        log.error(
            "environment %r raised in %s (rollout %s)",
            environment.name,
            what,
            rollout_id,
            exc_info=exc,
        )
        raise EnvironmentRaisedError(describe(environment, what, exc)) from None


def describe(environment: Environment[Any], what: str, exc: BaseException) -> str:
    """``environment 'bank' raised ZeroDivisionError in tool 'deposit': division by zero
    (at bank.py:41 in deposit)``."""
    text = " ".join(str(exc).split()) or "(no message)"
    if len(text) > MESSAGE_CHARS:
        text = text[: MESSAGE_CHARS - 1] + "…"
    frame = _own_frame(environment, exc)
    where = "" if frame is None else f" (at {frame})"
    return f"environment {environment.name!r} raised {type(exc).__name__} in {what}: {text}{where}"


def _own_frame(environment: Environment[Any], exc: BaseException) -> str | None:
    """The innermost frame of the traceback in the environment's own module (where its
    code went wrong, not a library it called), else the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    try:
        own = inspect.getsourcefile(type(environment))
    except TypeError:
        own = None
    mine = [f for f in frames if own is not None and f.filename == own]
    frame = (mine or frames)[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
