"""The ``mcp:<spec file>`` environments: the tools of any MCP server as a resources server's tools.

Owns the reference (``mcp:examples/mcp_sqlite.yaml``, a path relative to the working
directory), the class made for each spec, the server's tools as the policy sees them, and the
episode's saved form: the log of its calls. The spec file's model
(:class:`~rollpoint.envs.mcp_spec.McpSpec`: the server to start or reach, which of its tools
the policy sees and the arguments the environment fills in, the tasks) is
:mod:`~rollpoint.envs.mcp_spec`'s; the one client connection per process
(:class:`~rollpoint.envs.mcp_connection.McpConnection`, through the official ``mcp`` SDK) is
:mod:`~rollpoint.envs.mcp_connection`'s.

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
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import ConfigDict, JsonValue, ValidationError

from rollpoint.common.extras import need
from rollpoint.envs.base import Environment, Tool, ToolArgumentError, ToolArguments
from rollpoint.envs.mcp_connection import (
    McpConnection,
    _describe,
    find_command,
    list_server_tools,
)
from rollpoint.envs.mcp_spec import (
    META_KEY,
    PREFIX,
    McpServerSpec,
    McpSetupCall,
    McpSpec,
    McpTasksSpec,
    McpToolSpec,
    load_spec,
)
from rollpoint.envs.tool_call import ToolContext
from rollpoint.protocol.episode import TaskRow, VerifyReply
from rollpoint.protocol.errors import (
    ConfigError,
    EnvironmentRaisedError,
    InvalidCheckpointStateError,
)
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import CheckpointMode

__all__ = [
    "META_KEY",
    "PREFIX",
    "McpArguments",
    "McpCall",
    "McpConnection",
    "McpEnvironment",
    "McpEpisode",
    "McpServerSpec",
    "McpSetupCall",
    "McpSpec",
    "McpTasksSpec",
    "McpTool",
    "McpToolSpec",
    "find_command",
    "list_server_tools",
    "load_spec",
    "mcp_environment",
    "result_text",
]

_TEMPLATE = re.compile(r"\{(task_id|rollout_id|turn|call_index|idempotency_key)\}")
_INVALID_PARAMS = -32602  # JSON-RPC: the server says the arguments are wrong
_CONNECTION_CLOSED = -32000  # the SDK's code for a request whose connection went away


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
