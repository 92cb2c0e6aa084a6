"""How a tool is called: its call context, its calling convention, and where it runs.

Owns :class:`ToolContext` (what a tool may know about the call it serves: the idempotency
key, the rollout, attempt and task, the turn and call index, a logger), the
:func:`slow_tool` mark, :func:`check_tools` (the environment lookup's check of every tool's
signature), and :class:`ToolRunner`, which the resources server builds once per
environment when it loads it and calls for every tool call it applies.

A tool's ``run`` is one of (found once, at load, with :func:`inspect.signature`; a
signature that fits neither is refused there, in one line naming the environment and the
tool):

- ``run(state, args) -> str`` or ``run(state, args, ctx) -> str``, synchronous: runs on
  the server's event loop, between two awaits, like every tool before it. Marked with
  :func:`slow_tool`, it runs in a worker thread of a bounded pool instead, so other
  episodes' calls and the control verbs go on meanwhile;
- ``async def run(state, args[, ctx]) -> str``: awaited on the event loop.

The measured threshold (:data:`SLOW_CALL_S`): a synchronous tool that is not marked and
takes longer than 50 ms on the loop is named once in a warning. It is moved to a worker
thread from then on only when the environment says its tools may run in a thread
(``Environment.offload_slow_tools``): a thread touches the episode's state from another
thread (an SQLite connection refuses that; so may other handles), and only the author can
promise that is safe. A tool marked slow is run in a thread from its first call.

A tool that changes something outside the episode's state makes that change through
:meth:`ToolContext.effect` (or ``await ctx.aeffect``), which records it exactly once
(:mod:`rollpoint.envs.effects`).

The server (not this module) keeps one call per episode at a time and decides what a
checkpoint sees while a call is away from the loop; this module only runs the call.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar, cast

from rollpoint.protocol.errors import ConfigError, ToolArgumentError

if TYPE_CHECKING:
    from rollpoint.envs.base import Environment, Tool
    from rollpoint.envs.effects import CallEffects

SLOW_CALL_S = 0.05
"""A synchronous tool call on the event loop longer than this is slow: named once in a
warning, and moved to a worker thread from then on if the environment allows it."""
SLOW_TOOL_THREADS = 32
"""Worker threads per resources server for slow tools: more slow calls wait for a thread."""

_SLOW_MARK = "__rollpoint_slow_tool__"

F = TypeVar("F", bound=Callable[..., Any])


def slow_tool(run: F) -> F:
    """Mark a synchronous tool function as slow: the server runs it in a worker thread.

    Use it for a tool that waits (a subprocess, a test suite, a remote call made with a
    blocking client). The episode's state is then touched from that thread; the server
    runs one call per episode at a time, so a tool needs no lock for its own state."""
    setattr(run, _SLOW_MARK, True)
    return run


def is_slow_tool(run: Callable[..., Any]) -> bool:
    return bool(getattr(run, _SLOW_MARK, False))


class _CallLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Prefixes every record with the call it belongs to."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        return f"[{self.extra['call'] if self.extra else ''}] {msg}", kwargs


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolContext:
    """What a tool knows about the call it serves; made by the server for each call applied.

    A tool takes it as a third argument: ``run(state, args, ctx)``. Fields are keyword-only
    and new ones may be added (a tool reads the ones it needs)."""

    idempotency_key: str
    """The call's key as one string, ``<rollout_id>/<turn>/<call_index>`` (a rollout id
    never holds ``/``): the same for every try of this call, also after a restore (the
    attempt is not part of it, as it is not part of the server's own idempotency key), and
    different for any other call of any rollout. Pass it to an outside system that takes
    idempotency keys, or write it with the effect so that a repeat can be recognised."""
    rollout_id: str
    attempt: int
    """The episode's attempt: 0, then +1 at each restore that continued it."""
    task_id: str
    environment: str
    """The environment's name."""
    tool: str
    turn: int
    call_index: int
    """The call's position among the tool calls of its turn (0, 1, …)."""
    logger: logging.LoggerAdapter  # type: ignore[type-arg]
    """Logs under ``rollpoint.envs.<environment>``, each line prefixed with the rollout,
    attempt, turn and call index."""
    effects: CallEffects | None = None
    """The call's effects (the server's journal, or in memory); use :meth:`effect`."""

    def effect(self, name: str, fn: Callable[[str], Any]) -> Any:
        """Make an effect outside the episode's state exactly once, from a synchronous
        tool (marked :func:`slow_tool`: it runs in a worker thread). ``fn(key)`` makes it,
        given the effect's idempotency key (``<idempotency_key>/<name>``, to pass to the
        outside system), and returns a JSON-safe result; a replay or re-issue of the call
        gets the recorded result without calling ``fn`` (:mod:`rollpoint.envs.effects`).
        ``name`` must be one of the environment's declared ``effects``."""
        return self._effects().run(name, fn)

    async def aeffect(self, name: str, fn: Callable[[str], Awaitable[Any]]) -> Any:
        """:meth:`effect` for an ``async def`` tool: ``fn(key)`` is awaited."""
        return await self._effects().arun(name, fn)

    def _effects(self) -> CallEffects:
        if self.effects is None:
            raise RuntimeError(f"tool {self.tool!r}: this context records no effects")
        return self.effects


def idempotency_key(rollout_id: str, turn: int, call_index: int) -> str:
    """The call's key as :attr:`ToolContext.idempotency_key` spells it."""
    return f"{rollout_id}/{turn}/{call_index}"


def tool_context(
    environment: str,
    tool: str,
    *,
    rollout_id: str,
    attempt: int,
    task_id: str,
    turn: int,
    call_index: int,
    effects: CallEffects | None = None,
) -> ToolContext:
    """The context of one call (the server makes one per call it applies)."""
    where = f"rollout {rollout_id}#{attempt} turn {turn} call {call_index} {tool}"
    return ToolContext(
        idempotency_key=idempotency_key(rollout_id, turn, call_index),
        rollout_id=rollout_id,
        attempt=attempt,
        task_id=task_id,
        environment=environment,
        tool=tool,
        turn=turn,
        call_index=call_index,
        logger=_CallLogger(logging.getLogger(f"rollpoint.envs.{environment}"), {"call": where}),
        effects=effects,
    )


class _Where(Enum):
    LOOP = "loop"
    """Synchronous, run on the event loop."""
    THREAD = "thread"
    """Synchronous, run in a worker thread."""
    AWAITED = "awaited"
    """``async def``, awaited on the event loop."""


@dataclass
class _Convention:
    tool: Tool[Any, Any]
    takes_context: bool
    where: _Where
    warned: bool = False


def takes_context(environment: str, tool: Tool[Any, Any]) -> bool:
    """Whether ``tool.run`` takes ``(state, args, ctx)`` rather than ``(state, args)``."""
    refused = (
        f"environment {environment!r}: tool {tool.name!r}: run must take (state, args) or"
        f" (state, args, ctx)"
    )
    try:
        signature = inspect.signature(tool.run)
    except (TypeError, ValueError):
        raise ConfigError(f"{refused}; its signature cannot be read") from None
    # Three first: a run that can take a third argument gets the context.
    for count in (3, 2):
        try:
            signature.bind(*range(count))
        except TypeError:
            continue
        return count == 3
    raise ConfigError(f"{refused}, not {tool.run.__qualname__}{signature}") from None


def is_async(run: Callable[..., Any]) -> bool:
    # A callable object with an ``async def __call__`` counts too.
    return inspect.iscoroutinefunction(run) or inspect.iscoroutinefunction(
        getattr(run, "__call__", None)  # noqa: B004
    )


def check_tools(environment: Environment[Any]) -> None:
    """Refuse a tool of ``environment`` whose ``run`` fits no convention (ConfigError naming
    the environment and the tool): the environment lookup calls it, so a config naming such
    an environment is refused before any server starts."""
    for tool in environment.tool_table().values():
        takes_context(environment.name, tool)


class ToolRunner:
    """Every tool of one environment with its calling convention, found once at load."""

    def __init__(self, environment: Environment[Any], *, threads: int = SLOW_TOOL_THREADS) -> None:
        self._environment = environment
        self._offload = environment.offload_slow_tools
        self._tools: dict[str, _Convention] = {}
        for name, tool in environment.tool_table().items():
            if is_async(tool.run):
                where = _Where.AWAITED
            elif is_slow_tool(tool.run):
                where = _Where.THREAD
            else:
                where = _Where.LOOP
            self._tools[name] = _Convention(tool, takes_context(environment.name, tool), where)
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def runs_on_loop(self, tool_name: str) -> bool:
        """Whether a call of this tool runs start to end without giving up the event loop
        (an unknown tool does: it is an error answer)."""
        convention = self._tools.get(tool_name)
        return convention is None or convention.where is _Where.LOOP

    async def call(
        self,
        state: Any,
        tool_name: str,
        arguments: Mapping[str, Any],
        context: Callable[[], ToolContext],
    ) -> str:
        """Run one call; :class:`ToolArgumentError` when it cannot run as asked. ``context``
        makes the call's context, only for a tool that takes one."""
        convention = self._tools.get(tool_name)
        if convention is None:
            known = ", ".join(self._tools) or "none"
            raise ToolArgumentError(f"unknown tool '{tool_name}' (available tools: {known})")
        tool = convention.tool
        args = tool.parse(arguments)
        call: tuple[Any, ...] = (
            (state, args, context()) if convention.takes_context else (state, args)
        )
        if convention.where is _Where.AWAITED:
            return await cast(Awaitable[str], tool.run(*call))
        if convention.where is _Where.THREAD:
            loop = asyncio.get_running_loop()
            # The call's context variables go with it to the thread (a replay from the
            # journal is marked by one: tool_journal.replaying()), as asyncio.to_thread does.
            ctx = contextvars.copy_context()
            return await loop.run_in_executor(
                self._executor(), lambda: cast(str, ctx.run(tool.run, *call))
            )
        started = time.perf_counter()
        try:
            return cast(str, tool.run(*call))
        finally:
            self._measured(convention, time.perf_counter() - started)

    def _measured(self, convention: _Convention, elapsed: float) -> None:
        if elapsed <= SLOW_CALL_S or convention.warned:
            return
        convention.warned = True
        name, tool = self._environment.name, convention.tool.name
        if self._offload:
            convention.where = _Where.THREAD
            logging.getLogger(__name__).warning(
                "environment %r: tool %r took %.0f ms on the event loop; it runs in a worker"
                " thread from now on (offload_slow_tools)",
                name,
                tool,
                elapsed * 1000,
            )
        else:
            logging.getLogger(__name__).warning(
                "environment %r: tool %r took %.0f ms on the event loop, holding every other"
                " call and control verb of this server; mark it @slow_tool or make it async"
                " (see docs/environments.md)",
                name,
                tool,
                elapsed * 1000,
            )

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="rollpoint-tool")
        return self._pool

    def close(self) -> None:
        """Stop the worker threads once their calls end (calls not started are dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
