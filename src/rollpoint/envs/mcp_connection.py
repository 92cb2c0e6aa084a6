"""The client connection to an MCP server, through the official ``mcp`` SDK.

Owns :class:`McpConnection` (one client session to the server a spec names: a stdio child
started with the command found on PATH or beside the Python running rollpoint
(:func:`find_command`), or a streamable HTTP endpoint; opened again after it broke), the one
line an error becomes (anyio's exception groups looked inside), and
:func:`list_server_tools`, which asks the server for its tools when a reference is resolved.
The ``mcp`` SDK comes with the ``mcp`` extra and is imported only when a connection opens.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import threading
from contextlib import AsyncExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

from rollpoint.envs.mcp_spec import McpSpec
from rollpoint.protocol.errors import ConfigError


# ---- the connection ---------------------------------------------------------------------
def _describe(exc: BaseException) -> str:
    """One line for an exception, looking inside the exception groups anyio raises."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if type(exc) is ConnectionError:  # ours: already says what happened
        return " ".join(str(exc).split())[:300]
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


class McpConnection:
    """One client session to the server, held open by a task on the loop that opened it
    (the SDK's transports are context managers entered and left in one task)."""

    def __init__(self, spec: McpSpec, where: str) -> None:
        self.spec = spec
        self.where = where
        self._session: Any = None
        self._current: Any = None
        """The session last opened (kept after it ends: :meth:`drop` compares with it)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Future[None] | None = None
        self._closing: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.broken: str | None = None

    async def _transport(self, stack: AsyncExitStack) -> tuple[Any, Any]:
        """The read and write streams to the server, closed with ``stack``."""
        from mcp.client.stdio import StdioServerParameters, stdio_client

        server = self.spec.server
        if server.command is not None:
            params = StdioServerParameters(
                command=find_command(server.command[0]),
                args=server.command[1:],
                env={**_default_env(), **server.env},
                cwd=server.cwd,
            )
            read, write = await stack.enter_async_context(stdio_client(params))
            return read, write
        import httpx
        from mcp.client.streamable_http import streamable_http_client

        assert server.url is not None
        client = await stack.enter_async_context(
            httpx.AsyncClient(
                headers=server.headers,
                timeout=httpx.Timeout(self.spec.timeout_s),
                follow_redirects=True,
            )
        )
        streams = await stack.enter_async_context(
            streamable_http_client(server.url, http_client=client)
        )
        return streams[0], streams[1]

    async def _hold(self, opened: asyncio.Future[None], closing: asyncio.Event) -> None:
        from mcp import ClientSession

        try:
            async with AsyncExitStack() as stack:
                read, write = await self._transport(stack)
                timeout = timedelta(seconds=self.spec.timeout_s)
                async with ClientSession(read, write, read_timeout_seconds=timeout) as session:
                    await session.initialize()
                    self._session = self._current = session
                    opened.set_result(None)
                    await closing.wait()
        except BaseException as exc:  # reported to the waiting caller, then raised again
            self.broken = _describe(exc)
            if not opened.done():
                opened.set_exception(ConnectionError(self.broken))
            if not isinstance(exc, Exception):
                raise
        finally:
            self._session = None

    async def session(self) -> Any:
        """The open session (opened now if need be); ConnectionError saying why not."""
        loop = asyncio.get_running_loop()
        # First use, a new loop (a test's asyncio.run), or the last connection ended (the
        # server exited or hung up: the calls it had fail, later ones start it again).
        if self._loop is not loop or (self._task is not None and self._task.done()):
            self._loop, self._session, self.broken = loop, None, None
            self._opening = loop.create_future()
            self._closing = asyncio.Event()
            self._task = loop.create_task(self._hold(self._opening, self._closing))
        assert self._opening is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._opening), self.spec.timeout_s)
        except TimeoutError:
            raise ConnectionError(f"no answer within {self.spec.timeout_s:g} s") from None
        if self._session is None:
            raise ConnectionError(self.broken or "the connection closed")
        return self._session

    async def drop(self, session: Any) -> None:
        """Close ``session`` if it is still the current one (a call found it broken; the
        other calls that failed with it must not close the one opened since)."""
        if session is self._current:
            await self.close()

    async def close(self) -> None:
        """End the session (a stdio server gets its end of input and exits); the next
        :meth:`session` opens a new one."""
        task, self._task = self._task, None
        if self._closing is not None and task is not None:
            self._closing.set()
            await asyncio.wait([task], timeout=self.spec.timeout_s)
        self._loop = self._session = None


def find_command(command: str) -> str:
    """``command`` as found on PATH, else beside the Python running rollpoint (a script
    installed in its virtual environment, not activated); ConnectionError when neither."""
    if os.sep in command or shutil.which(command) is not None:
        return command
    beside = Path(sys.executable).parent / command
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise ConnectionError(f"command {command!r} not found on PATH nor in {beside.parent}")


def _default_env() -> dict[str, str]:
    from mcp.client.stdio import get_default_environment

    env: dict[str, str] = get_default_environment()
    return env


def list_server_tools(spec: McpSpec, where: str) -> list[Any]:
    """The server's tools (``mcp.types.Tool``), asked once on a loop of our own in a thread
    (a caller may be inside a running loop); ConfigError in one line when that fails."""
    found: list[Any] = []
    failed: list[str] = []

    async def ask() -> None:
        connection = McpConnection(spec, where)
        try:
            session = await connection.session()
            cursor = None
            while True:
                page = await session.list_tools(cursor=cursor)
                found.extend(page.tools)
                cursor = page.nextCursor
                if not cursor:
                    break
        except Exception as exc:
            failed.append(_describe(exc))
        finally:
            await connection.close()

    thread = threading.Thread(target=lambda: asyncio.run(ask()), name="rollpoint-mcp-probe")
    thread.start()
    thread.join()
    if failed:
        server = spec.server.url or " ".join(spec.server.command or ())
        raise ConfigError(f"{where}: MCP server '{server}' cannot be used: {failed[0]}")
    return found
