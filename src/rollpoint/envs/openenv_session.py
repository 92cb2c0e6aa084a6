"""One OpenEnv session over OpenEnv's WebSocket protocol, and the event loop every session
of a process lives on.

Owns :class:`Session` (the messages OpenEnv's own ``EnvClient`` sends: ``reset``, ``step``,
``state``, ``close``), what a message that failed raises (:class:`SessionError`: the server
refused it, nothing applied; :class:`SessionLost`: the connection broke around it, whether
it was applied is unknown), and the one loop per process, in a daemon thread, that the
``openenv:`` environments (:mod:`rollpoint.envs.openenv_env`) wait on and await from.

Why not OpenEnv's ``GenericEnvClient`` itself: it reconnects on its own when its socket
closed, to a new environment never reset (a step there would land in another episode), and
importing it imports gradio (seconds per process). :class:`Session` speaks the same messages.
Sessions are async; the environment's interface is not: every session lives on one event
loop per process, in a daemon thread; the tool awaits its call from the server's loop, the
other methods wait for theirs. websockets comes with the ``openenv`` extra.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

_CALL_TIMEOUT_S = 60.0
T = TypeVar("T")

log = logging.getLogger(__name__)


# ---- the loop every session of this process lives on -----------------------------------
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    """One event loop per process, in a daemon thread: a WebSocket belongs to the loop that
    opened it, and the interface's synchronous methods are called from the server's loop."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="openenv loop", daemon=True).start()
            _LOOP = loop
        return _LOOP


def _wait(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run_coroutine_threadsafe(coroutine, _loop()).result(_CALL_TIMEOUT_S)


async def _await(coroutine: Coroutine[Any, Any, T]) -> T:
    """Await ``coroutine`` on the sessions' loop from another running loop."""
    future = asyncio.run_coroutine_threadsafe(coroutine, _loop())
    return await asyncio.wait_for(asyncio.wrap_future(future), _CALL_TIMEOUT_S)


# ---- one OpenEnv session ---------------------------------------------------------------
class SessionError(Exception):
    """The server answered a message with an error frame (``{"type": "error", "data":
    {"message", "code"}}``): nothing was applied."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(f"{message} (code {code})")
        self.message, self.code = message, code


class SessionLost(Exception):
    """The connection broke or timed out around a message: whether it was applied is unknown."""


class Session:
    """One OpenEnv WebSocket session (``/ws``): one environment instance on the server, alive
    as long as this connection. Speaks the messages OpenEnv's own client sends (``reset`` with
    ``seed`` and ``episode_id``, ``step`` with the action, ``state``, ``close``) and reads its
    replies (``observation``, ``state``, ``error``). Unlike OpenEnv's client, it never
    reconnects on its own: a new connection is a new, never reset environment, and a step
    sent there would be applied to another episode."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._broken = False
        """A message went unanswered (a timeout, a cancel): a reply may still come and would
        be read as the next message's, so nothing more is sent on this connection."""

    @classmethod
    async def open(cls, url: str) -> Session:
        """A new session; OSError or a ``websockets`` error when the server refuses it."""
        from websockets.asyncio.client import connect

        ws = await connect(
            "ws" + url.removeprefix("http") + "/ws",
            open_timeout=_CALL_TIMEOUT_S,
            max_size=100 * 2**20,
            proxy=None,
        )
        return cls(ws)

    async def ask(self, kind: str, data: Mapping[str, Any] | None = None) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed

        message: dict[str, Any] = {"type": kind} if data is None else {"type": kind, "data": data}
        if self._broken:
            raise SessionLost("the OpenEnv session was lost (a message went unanswered)")
        self._broken = True
        try:
            await self._ws.send(orjson.dumps(message).decode())
            raw = await asyncio.wait_for(self._ws.recv(), _CALL_TIMEOUT_S)
        except (ConnectionClosed, TimeoutError, OSError) as exc:
            await self.close()
            raise SessionLost(
                f"the OpenEnv session was lost ({type(exc).__name__}: {exc})"
            ) from None
        self._broken = False
        reply = orjson.loads(raw)
        body = reply.get("data") if isinstance(reply, dict) else None
        if not isinstance(body, dict):
            raise SessionLost(f"the OpenEnv session answered {str(raw)[:200]!r}")
        if reply.get("type") == "error":
            raise SessionError(str(body.get("message", "error")), str(body.get("code", "UNKNOWN")))
        return body

    async def close(self) -> None:
        from websockets.exceptions import ConnectionClosed
        from websockets.protocol import State

        try:
            if self._ws.state is State.OPEN:
                await self._ws.send(orjson.dumps({"type": "close"}).decode())
            await self._ws.close()
        except (ConnectionClosed, OSError) as exc:  # gone either way; the server reaps it
            log.debug("closing an OpenEnv session: %s", exc)
