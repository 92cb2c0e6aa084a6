"""The ``mcp:<spec file>`` environments: the tools of any MCP server as a resources server's tools.

Owns the reference (``mcp:examples/mcp_sqlite.yaml``, a path relative to the working
directory), the spec file's model (:class:`McpSpec`: the server to start or reach, which of
its tools the policy sees and the arguments the environment fills in, the tasks), the class
made for each spec, the one client connection per process (:class:`McpConnection`, through
the official ``mcp`` SDK), and the episode's saved form: the log of its calls.

- **Server**: stdio (``server.command``: a command the resources server starts as its
  child, one per resources server process; looked up on PATH, then beside the Python
  running rollpoint) or streamable HTTP (``server.url``). The tools
  are listed from the server when the reference is resolved (config load, then each server
  process): a server that cannot start or answer is one ConfigError line then.
- **Tools**: each listed tool (or the ones ``tools:`` names) becomes a tool the policy sees,
  with the server's description and input schema; arguments ``bind`` fills are taken out of
  that schema and set by the environment for every call (``{task_id}``, ``{rollout_id}``,
  ``{turn}``, ``{call_index}`` and ``{idempotency_key}`` are replaced in a string value).
  The policy's arguments are checked against the schema (JSON Schema) before the call.
- **Idempotency key**: every ``tools/call`` carries the call's key in the request's
  ``_meta`` under ``spec.meta_key`` (``rollpoint/idempotency_key``), where a server that
  deduplicates can read it; a server that takes a key as an argument gets it by ``bind``.
- **Results**: the result's text contents, joined (structured content as JSON when it has
  no text). ``isError`` results and JSON-RPC ``invalid params`` errors are tool errors the
  model reads; a call that fails otherwise (the server died, timed out, answered another
  JSON-RPC error) is an :class:`EnvironmentRaisedError` naming the server and the tool:
  the row fails, it is not retried as a transport fault. A connection that broke is
  opened again by the next call (a stdio server is started again).
- **Mode**: ``turn``, with the server's state outside rollpoint. Saved per episode: its
  calls (key, tool, arguments sent, result). The server keeps its own state, which no
  snapshot holds: a restored episode continues at its turn against whatever the server
  kept. The resources server's journal (``journal.enabled: true``, required) makes a call
  that completed before a crash never reach the server again: a re-issued call is answered
  from the journal (:func:`~rollpoint.servers.resources.tool_journal.recorded_result`). A
  call in flight at the crash (sent, not yet journaled) is sent again under the same key.
- **Verify**: the user's ``verify: module:function`` (``func(calls, task, final_message)
  -> float`` in [0, 1], ``calls`` as saved), else the share of calls that did not error.

The ``mcp`` SDK comes with the ``mcp`` extra: resolving an ``mcp:`` reference without it is
a one-line ConfigError.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, ClassVar

import yaml
from pydantic import ConfigDict, Field, JsonValue, ValidationError, model_validator

from rollpoint.common.extras import need
from rollpoint.envs.base import Environment, Tool, ToolArgumentError, ToolArguments
from rollpoint.envs.tool_call import ToolContext
from rollpoint.protocol.episode import TaskRow, VerifyReply
from rollpoint.protocol.errors import (
    ConfigError,
    EnvironmentRaisedError,
    InvalidCheckpointStateError,
)
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import CheckpointMode

PREFIX = "mcp:"
META_KEY = "rollpoint/idempotency_key"
_TEMPLATE = re.compile(r"\{(task_id|rollout_id|turn|call_index|idempotency_key)\}")
_INVALID_PARAMS = -32602  # JSON-RPC: the server says the arguments are wrong
_CONNECTION_CLOSED = -32000  # the SDK's code for a request whose connection went away


# ---- the spec file ----------------------------------------------------------------------
class McpServerSpec(StrictModel):
    """Where the server is: a command to start (stdio) or a URL (streamable HTTP)."""

    command: list[str] | None = None
    """The stdio server's command and arguments, e.g. ``[mcp-server-sqlite, --db-path, x.db]``."""
    env: dict[str, str] = Field(default_factory=dict)
    """Added to the environment the stdio server is started with."""
    cwd: str | None = None
    url: str | None = None
    """A streamable HTTP server's endpoint, e.g. ``http://127.0.0.1:8000/mcp``."""
    headers: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerSpec:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of 'command' (stdio) or 'url' (streamable HTTP)")
        if self.command is not None and not self.command:
            raise ValueError("'command' is empty")
        return self


class McpToolSpec(StrictModel):
    bind: dict[str, JsonValue] = Field(default_factory=dict)
    """Arguments the environment sets on every call of this tool (hidden from the policy)."""


class McpTasksSpec(StrictModel):
    prompt: str
    """The opening user message of task ``i``; ``{index}`` and ``{task_id}`` are replaced."""
    params: dict[str, JsonValue] = Field(default_factory=dict)


class McpSetupCall(StrictModel):
    tool: str
    arguments: dict[str, JsonValue] = Field(default_factory=dict)


class McpSpec(StrictModel):
    """The spec file ``mcp:<path>`` names (YAML)."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z_][\w-]*$")] | None = None
    """What task ids start with; the file's stem by default."""
    server: McpServerSpec
    tools: dict[str, McpToolSpec] | None = None
    """The server's tools the policy sees (all of them when absent), with bound arguments."""
    setup: list[McpSetupCall] = Field(default_factory=list)
    """Calls made once per connection before any episode's (idempotent: every process runs them)."""
    tasks: McpTasksSpec
    verify: Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")] | None = None
    meta_key: str = META_KEY
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """Bound on starting the server and on each call."""


def load_spec(ref: str) -> tuple[McpSpec, Path]:
    path = Path(ref.removeprefix(PREFIX))
    where = f"environment {ref!r}"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path} ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: {path} is not YAML ({' '.join(str(exc).split())})") from None
    try:
        return McpSpec.model_validate(data), path
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "top level"
        raise ConfigError(f"{where}: {path}: key '{loc}': {err['msg']}") from None


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


# ---- the environment --------------------------------------------------------------------
class McpArguments(ToolArguments):
    """The policy's arguments as given: the tool's JSON schema checks them, not a model."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


@dataclass(frozen=True)
class McpTool(Tool[Any, McpArguments]):
    """One server tool as the policy sees it: its schema without the bound arguments."""

    schema: dict[str, Any] = field(default_factory=dict)
    bind: Mapping[str, JsonValue] = field(default_factory=dict)

    def spec(self) -> dict[str, JsonValue]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.schema,
            },
        }

    def parse(self, arguments: Mapping[str, Any]) -> McpArguments:
        import jsonschema

        bound = sorted(set(arguments) & set(self.bind))
        if bound:
            raise ToolArgumentError(f"{self.name}: argument '{bound[0]}' is set by the environment")
        try:
            jsonschema.validate(dict(arguments), self.schema)
        except jsonschema.ValidationError as exc:
            loc = ".".join(str(p) for p in exc.absolute_path) or "arguments"
            raise ToolArgumentError(f"{self.name}: {loc}: {exc.message}") from None
        except jsonschema.SchemaError as exc:  # the server's schema: the server's fault
            raise EnvironmentRaisedError(
                f"MCP tool {self.name!r} has an invalid input schema: {exc.message}"
            ) from None
        return McpArguments.model_validate(dict(arguments))


def _policy_schema(schema: Mapping[str, Any], bind: Mapping[str, Any]) -> dict[str, Any]:
    reduced = dict(schema) or {"type": "object"}
    props = {k: v for k, v in dict(reduced.get("properties") or {}).items() if k not in bind}
    reduced["properties"] = props
    required = [r for r in reduced.get("required") or () if r not in bind]
    if required:
        reduced["required"] = required
    else:
        reduced.pop("required", None)
    return reduced


def _fill(value: JsonValue, context: ToolContext) -> JsonValue:
    if isinstance(value, str):
        return _TEMPLATE.sub(lambda m: str(getattr(context, m[1])), value)
    if isinstance(value, list):
        return [_fill(v, context) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, context) for k, v in value.items()}
    return value


def result_text(result: Any) -> str:
    """What the policy reads of a ``CallToolResult``: its text contents, joined by blank
    lines; its structured content as JSON when it has no text; other contents named."""
    parts: list[str] = []
    for item in result.content:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind == "resource" and hasattr(item.resource, "text"):
            parts.append(item.resource.text)
        else:
            parts.append(f"[{kind or 'content'} omitted]")
    if not parts and result.structuredContent is not None:
        parts.append(json.dumps(result.structuredContent, sort_keys=True))
    return "\n\n".join(parts)


class McpCall(StrictModel):
    key: str
    tool: str
    arguments: dict[str, JsonValue]
    """As sent to the server, bound arguments included."""
    result: str
    is_error: bool
    journal: bool = False
    """Answered from the journal after a restore: not sent again."""


class _Saved(StrictModel):
    calls: list[McpCall]


@dataclass
class McpEpisode:
    calls: list[McpCall] = field(default_factory=list)


Verify = Callable[[list[dict[str, Any]], TaskRow, str | None], float]


@functools.cache
def mcp_environment(ref: str) -> type[McpEnvironment]:
    """The environment class ``mcp:<spec file>`` names, made once per process (the server's
    tools listed); ConfigError naming the reference when the spec, the server or a tool
    named in the spec is at fault."""
    where = f"environment {ref!r}"
    need("mcp", where)
    spec, path = load_spec(ref)
    verify = _load_verify(spec.verify, where) if spec.verify else None
    listed = {tool.name: tool for tool in list_server_tools(spec, where)}
    wanted = spec.tools if spec.tools is not None else {n: McpToolSpec() for n in listed}
    for setup in spec.setup:
        if setup.tool not in listed:
            raise ConfigError(f"{where}: setup: the server has no tool {setup.tool!r}")
    specs: dict[str, tuple[str, dict[str, Any], dict[str, JsonValue]]] = {}
    for name, tool_spec in wanted.items():
        tool = listed.get(name)
        if tool is None:
            have = ", ".join(sorted(listed)) or "none"
            raise ConfigError(f"{where}: the server has no tool {name!r} (it has: {have})")
        schema = dict(tool.inputSchema or {})
        unknown = sorted(set(tool_spec.bind) - set(schema.get("properties") or {}))
        if unknown:
            raise ConfigError(
                f"{where}: tools.{name}.bind: {name} takes no argument {unknown[0]!r}"
            )
        described = tool.description or tool.title or name
        specs[name] = (described, _policy_schema(schema, tool_spec.bind), dict(tool_spec.bind))
    attrs = {
        "name": ref,
        "task_prefix": re.sub(r"[^A-Za-z0-9_-]", "_", spec.name or path.stem),
        "reference": ref,
        "spec": spec,
        "tool_specs": specs,
        "verify_function": staticmethod(verify) if verify is not None else None,
        "__module__": __name__,
        "__doc__": f"The tools of the MCP server {path} names.",
    }
    return type(f"Mcp[{path.stem}]", (McpEnvironment,), attrs)


def _load_verify(path: str, where: str) -> Verify:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: quote whatever it raised
        raise ConfigError(
            f"{where}: verify: cannot import {module_name!r} ({type(exc).__name__}: {exc})"
        ) from None
    value = getattr(module, attr, None)
    if not callable(value):
        raise ConfigError(f"{where}: verify: {path} is not a function")
    verify: Verify = value
    return verify


class McpEnvironment(Environment[McpEpisode]):
    """The tools of one MCP server; :func:`mcp_environment` makes one class per spec file."""

    name: ClassVar[str] = "mcp"
    reference: ClassVar[str] = ""
    task_prefix: ClassVar[str] = "mcp"
    spec: ClassVar[McpSpec]
    tool_specs: ClassVar[dict[str, tuple[str, dict[str, Any], dict[str, JsonValue]]]] = {}
    verify_function: ClassVar[Verify | None] = None
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.TURN
    reproducible_start: ClassVar[bool] = True  # no calls yet

    def __init__(self) -> None:
        if not self.reference:
            raise ConfigError(f"environment {self.name!r}: name it mcp:<spec file>")
        super().__init__()
        self._connection = McpConnection(self.spec, f"environment {self.reference!r}")
        self._setup: tuple[Any, asyncio.Future[None]] | None = None
        """The session the spec's setup calls ran (or run) on, and their outcome."""
        self._tools = {
            name: McpTool(
                name=name,
                description=description,
                arguments=McpArguments,
                run=self._call,
                schema=schema,
                bind=bind,
            )
            for name, (description, schema, bind) in self.tool_specs.items()
        }

    def tool_table(self) -> Mapping[str, Tool[McpEpisode, Any]]:
        return self._tools

    def task_id(self, index: int) -> str:
        return f"{self.task_prefix}-{index:04d}"

    def _make_task(self, index: int, rng: Any) -> TaskRow:
        task_id = self.task_id(index)
        prompt = self.spec.tasks.prompt.replace("{index}", str(index))
        return TaskRow(
            task_id=task_id,
            environment=self.reference,
            prompt=prompt.replace("{task_id}", task_id),
            params=dict(self.spec.tasks.params),
        )

    # ---- calls -------------------------------------------------------------------------
    async def _session(self, tool: str) -> Any:
        try:
            session = await self._connection.session()
            if self._setup is None or self._setup[0] is not session:
                # Once per session, before any call on it: concurrent first calls wait.
                self._setup = (session, asyncio.ensure_future(self._run_setup(session)))
            await asyncio.shield(self._setup[1])
        except Exception as exc:
            raise self._failed(tool, exc) from None
        return session

    async def _run_setup(self, session: Any) -> None:
        for setup in self.spec.setup:
            result = await session.call_tool(setup.tool, setup.arguments)
            if result.isError:
                raise ConnectionError(f"setup call {setup.tool!r} failed: {result_text(result)}")

    def _failed(self, tool: str, exc: BaseException) -> EnvironmentRaisedError:
        server = self.spec.server.url or self.spec.server.command[0]  # type: ignore[index]
        return EnvironmentRaisedError(
            f"environment {self.name!r}: MCP server {server!r}: call of tool {tool!r} failed"
            f" ({_describe(exc)})"
        )

    async def _call(self, state: McpEpisode, args: McpArguments, context: ToolContext) -> str:
        from rollpoint.servers.resources.tool_journal import recorded_result

        tool = self._tools[context.tool]
        sent = {**(args.model_extra or {}), **_fill(dict(tool.bind), context)}  # type: ignore[dict-item]
        recorded = recorded_result()
        if recorded is not None:
            # Completed before the restore: the server did it then; never send it again.
            call = McpCall(
                key=context.idempotency_key,
                tool=tool.name,
                arguments=sent,
                result=recorded.content,
                is_error=recorded.is_error,
                journal=True,
            )
        else:
            call = await self._send(tool.name, sent, context)
        state.calls.append(call)
        if call.is_error:
            raise ToolArgumentError(call.result)
        return call.result

    async def _send(self, tool: str, sent: dict[str, Any], context: ToolContext) -> McpCall:
        from mcp.shared.exceptions import McpError

        session = await self._session(tool)
        meta = {self.spec.meta_key: context.idempotency_key}
        try:
            result = await session.call_tool(tool, sent, meta=meta)
        except McpError as exc:
            if exc.error.code == _CONNECTION_CLOSED:
                await self._connection.drop(session)  # the next call connects again
            if exc.error.code != _INVALID_PARAMS:
                raise self._failed(tool, exc) from None
            text, is_error = f"error: {tool}: {exc.error.message}", True
        except Exception as exc:  # the transport failed: the next call connects again
            await self._connection.drop(session)
            raise self._failed(tool, exc) from None
        else:
            text, is_error = result_text(result), bool(result.isError)
        return McpCall(
            key=context.idempotency_key, tool=tool, arguments=sent, result=text, is_error=is_error
        )

    # ---- episodes ----------------------------------------------------------------------
    def start(self, task: TaskRow) -> McpEpisode:
        return McpEpisode()

    def verify(self, state: McpEpisode, task: TaskRow, final_message: str | None) -> VerifyReply:
        errors = sum(c.is_error for c in state.calls)
        answered = sum(c.journal for c in state.calls)
        detail = {"calls": len(state.calls), "errors": errors, "from_journal": answered}
        verify = type(self).__dict__.get("verify_function")
        if verify is not None:  # a staticmethod in the made class's own namespace
            calls = [c.model_dump(mode="json") for c in state.calls]
            reward = float(verify.__func__(calls, task, final_message))
        else:
            reward = (len(state.calls) - errors) / len(state.calls) if state.calls else 0.0
        return VerifyReply(reward=min(1.0, max(0.0, reward)), detail=detail)

    def export_state(self, state: McpEpisode) -> dict[str, JsonValue]:
        return {"calls": [c.model_dump(mode="json") for c in state.calls]}

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> McpEpisode:
        try:
            saved = _Saved.model_validate(dict(exported))
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise InvalidCheckpointStateError(
                f"environment {self.name!r}, task {task.task_id}: bad saved state at '{loc}':"
                f" {err['msg']}"
            ) from None
        return McpEpisode(calls=list(saved.calls))
