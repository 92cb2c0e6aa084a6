"""The environment interface: tasks, tools, per-episode state, verifier, export and restore.

An :class:`Environment` is stateless itself: everything an episode owns lives in the state
object returned by :meth:`Environment.start`, so one environment instance serves every
episode of a resources server. The resources server (``rollpoint.servers.resources``)
owns the episodes, the idempotency table and HTTP; this module owns none of that.

Tools are declared as :class:`Tool` entries whose arguments are a strict pydantic model:
the same model gives the OpenAI JSON schema and validates what the model sent, so a missing,
extra or wrong-typed argument becomes one readable :class:`ToolArgumentError` for the model.

``export_state``/``restore_state`` must be exact: a restored episode continues exactly as
the original would have (same database rows, same next card).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeAlias, TypeVar, cast

from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError

from rollpoint.envs.effects import (
    CallEffects,
    InDoubtEffect,
    MemoryEffects,
    Reconciled,
    check_effect_name,
)
from rollpoint.envs.tool_call import ToolContext, is_async, takes_context, tool_context
from rollpoint.protocol.episode import TaskRow, VerifyReply
from rollpoint.protocol.errors import ConfigError
from rollpoint.protocol.errors import ToolArgumentError as ToolArgumentError  # environments' import
from rollpoint.protocol.participant import CheckpointMode

StateT = TypeVar("StateT")
ArgsT = TypeVar("ArgsT", bound="ToolArguments")

ToolRun: TypeAlias = (
    Callable[[StateT, ArgsT], str]
    | Callable[[StateT, ArgsT, ToolContext], str]
    | Callable[[StateT, ArgsT], Awaitable[str]]
    | Callable[[StateT, ArgsT, ToolContext], Awaitable[str]]
)
"""A tool's function: ``(state, args)`` or ``(state, args, ctx)``, plain or ``async def``
(:mod:`rollpoint.envs.tool_call` says how each is run)."""


class ToolArguments(BaseModel):
    """Base of every tool's argument model: strict types, no unknown arguments."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class NoArguments(ToolArguments):
    """For tools that take no arguments."""


def _strip_titles(schema: Any) -> Any:
    # pydantic adds a "title" to every node; OpenAI tool schemas do not need them and
    # they would shadow a property that is itself named "title".
    if isinstance(schema, dict):
        return {
            key: (_strip_titles(value) if key != "properties" else _strip_props(value))
            for key, value in schema.items()
            if key != "title"
        }
    return schema


def _strip_props(props: dict[str, Any]) -> dict[str, Any]:
    return {name: _strip_titles(node) for name, node in props.items()}


def _describe_validation_error(tool: str, exc: ValidationError) -> str:
    parts: list[str] = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "arguments"
        if err["type"] == "missing":
            parts.append(f"missing required argument '{loc}'")
        elif err["type"] == "extra_forbidden":
            parts.append(f"unexpected argument '{loc}'")
        elif err["type"] == "value_error":
            parts.append(f"argument '{loc}': {err['ctx']['error']}")
        else:
            parts.append(f"argument '{loc}': {err['msg'].lower()}")
    return f"{tool}: " + "; ".join(parts)


@dataclass(frozen=True)
class Tool(Generic[StateT, ArgsT]):
    """One tool: its name and description for the model, its arguments, and what it does."""

    name: str
    description: str
    arguments: type[ArgsT]
    run: ToolRun[StateT, ArgsT]
    """Applies the call to the episode state and returns the text the model sees; may take
    the call's :class:`~rollpoint.envs.tool_call.ToolContext` as a third argument, may be
    ``async def``, may be marked :func:`~rollpoint.envs.tool_call.slow_tool`."""

    def spec(self) -> dict[str, JsonValue]:
        """The OpenAI function-tool spec."""
        parameters: dict[str, JsonValue] = _strip_titles(self.arguments.model_json_schema())
        # The model's docstring is for us; the tool's description is for the model.
        parameters.pop("description", None)
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": parameters,
            },
        }

    def parse(self, arguments: Mapping[str, Any]) -> ArgsT:
        try:
            return self.arguments.model_validate(dict(arguments))
        except ValidationError as exc:
            raise ToolArgumentError(_describe_validation_error(self.name, exc)) from None


def check_declarations(environment: Environment[Any]) -> None:
    """Refuse, in one line naming the environment, what its class declares wrongly: an
    effect name that cannot be a key, an ``external`` mode without ``version``."""
    for name in sorted(environment.effects):
        try:
            check_effect_name(environment.name, name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if (
        environment.checkpoint_mode is CheckpointMode.EXTERNAL
        and type(environment).version is Environment.version
    ):
        raise ConfigError(
            f"environment {environment.name!r}: checkpoint_mode external needs a version(state)"
            " method (the external state's own version or digest)"
        )


class Environment(ABC, Generic[StateT]):
    """One kind of task with its tools; per-episode state lives in ``StateT`` objects."""

    name: ClassVar[str]
    checkpoint_mode: ClassVar[CheckpointMode]
    reproducible_start: ClassVar[bool] = False
    """``start(task)`` builds the same state every time for the same task: then an episode
    no tool call has touched is saved as its task alone, and a restore starts it again
    (a checkpoint copies no state for the thousands of episodes waiting for their first
    generation)."""

    offload_slow_tools: ClassVar[bool] = False
    """Its synchronous tools may run in a worker thread: one that took longer than
    :data:`~rollpoint.envs.tool_call.SLOW_CALL_S` on the event loop runs in a thread from
    then on. Off by default (a tool is only warned about): a thread touches the episode's
    state from another thread, which some handles refuse (an SQLite connection)."""

    effects: ClassVar[frozenset[str]] = frozenset()
    """The names of the effects its tools make outside the episode's state through
    ``ctx.effect`` (:mod:`rollpoint.envs.effects`); an undeclared name is refused. Declared
    effects are journaled in the resources server's journal whether or not
    ``journal.enabled`` is on (the exactly-once promise is the environment's, not a
    setting's), so a server that runs such an environment needs a local snapshot store."""

    # ---- tasks -------------------------------------------------------------------------
    def make_tasks(self, n: int, seed: int) -> list[TaskRow]:
        """``n`` synthetic tasks, the same for the same seed.

        Task ``i`` depends only on ``(seed, i)``, so a longer list extends a shorter one.
        """
        if n < 0:
            raise ConfigError(f"{self.name}: the number of tasks must be >= 0, got {n}")
        return [self._make_task(i, random.Random(f"{self.name}/{seed}/{i}")) for i in range(n)]

    def task_id(self, index: int) -> str:
        return f"{self.name}-{index:04d}"

    @abstractmethod
    def _make_task(self, index: int, rng: random.Random) -> TaskRow: ...

    # ---- tools -------------------------------------------------------------------------
    def tool_table(self) -> Mapping[str, Tool[StateT, Any]]:
        """The environment's tools by name; none by default."""
        return {}

    def tools(self) -> list[dict[str, JsonValue]]:
        """OpenAI function-tool specs of every tool, in a stable order."""
        return [tool.spec() for tool in self.tool_table().values()]

    def call(
        self,
        state: StateT,
        tool_name: str,
        arguments: Mapping[str, Any],
        context: ToolContext | None = None,
    ) -> str:
        """Run one call of a synchronous tool here and now (a test's shortcut; the
        resources server runs every kind of tool through
        :class:`~rollpoint.envs.tool_call.ToolRunner`); :class:`ToolArgumentError` when it
        cannot run as asked. A tool that takes the call's context gets ``context``, or
        without one a context of rollout ``local``, turn 0, call 0."""
        table = self.tool_table()
        tool = table.get(tool_name)
        if tool is None:
            known = ", ".join(table) or "none"
            raise ToolArgumentError(f"unknown tool '{tool_name}' (available tools: {known})")
        if is_async(tool.run):
            raise TypeError(f"tool {tool_name!r} is async def: await it through a ToolRunner")
        args = tool.parse(arguments)
        if not takes_context(self.name, tool):
            return cast(str, tool.run(state, args))  # type: ignore[call-arg]
        if context is None:
            where: dict[str, Any] = {
                "rollout_id": "local",
                "attempt": 0,
                "task_id": "local",
                "turn": 0,
            }
            memory = MemoryEffects()
            effects = CallEffects(
                self,
                state,
                memory,
                **where,
                tool=tool_name,
                call_index=0,
                loop=None,
                counts=memory.counts,
            )
            context = tool_context(self.name, tool_name, **where, call_index=0, effects=effects)
        return cast(str, tool.run(state, args, context))  # type: ignore[call-arg]

    # ---- episodes ----------------------------------------------------------------------
    @abstractmethod
    def start(self, task: TaskRow) -> StateT:
        """Fresh state for one episode of ``task``."""

    @abstractmethod
    def verify(self, state: StateT, task: TaskRow, final_message: str | None) -> VerifyReply:
        """The episode's reward in [0, 1] and a detail of how it was reached."""

    @abstractmethod
    def export_state(self, state: StateT) -> dict[str, JsonValue]:
        """The whole episode state as JSON-safe data (bytes as base64). New data: nothing
        the state keeps changing afterwards."""

    def capture_state(self, state: StateT) -> Callable[[], dict[str, JsonValue]]:
        """What :meth:`export_state` would return now, made when the returned function is
        called (later, in a snapshot's writer thread, possibly after the state changed).

        A checkpoint captures every changed episode inside its pause: override this to
        take only the copy there and leave the encoding for later (the workplace takes
        the SQLite image, ~7 µs, and leaves its base64, ~28 µs). By default the export
        is made now."""
        exported = self.export_state(state)
        return lambda: exported

    @abstractmethod
    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> StateT:
        """State equal to the exported one; ``InvalidCheckpointStateError`` when malformed."""

    # ---- side effects ------------------------------------------------------------------
    def side_effects(self, state: StateT) -> Counter[str]:
        """Every side effect the episode's state holds (a row inserted, an email sent),
        each named by one string and counted: an effect counted twice was applied twice.
        Read from the state itself, never from the transcript: ``rollpoint chaos`` checks
        exactly-once tool effects (I2) against it. None by default."""
        return Counter()

    def expected_side_effects(self, task: TaskRow) -> list[str]:
        """The effects a finished episode of ``task`` holds once each, named as
        :meth:`side_effects` names them (none by default)."""
        return []

    # ---- state that lives outside (checkpoint_mode external) ---------------------------
    def version(self, state: StateT) -> str:
        """The external state's own version or digest now (``external`` mode: required).
        Journaled after every tool call and saved at each checkpoint; a restored episode
        continues only on state :meth:`attach` finds at the version it was last journaled
        at. It must change whenever the state does (a counter of applied calls, a commit
        id, a content hash)."""
        raise NotImplementedError(f"environment {self.name!r} defines no version()")

    def attach(self, task: TaskRow, rollout_id: str) -> StateT | None:
        """Reconnect to the external state of ``rollout_id`` after a crash (``external``
        mode): a handle on it, or None when it no longer exists. Whether it is at the right
        version is checked with :meth:`version`; a handle that is not is closed. None by
        default: every episode restarts."""
        return None

    def snapshot(self, state: StateT) -> JsonValue:
        """A handle on a copy of the external state taken now (a sandbox provider's
        snapshot id, a copied folder's path), saved with the checkpoint, or None when its
        owner cannot take one (the default). Called when the episode's saved form is made
        (at most once per checkpoint for an episode changed since the last one)."""
        return None

    def restore_snapshot(self, task: TaskRow, rollout_id: str, handle: JsonValue) -> StateT:
        """External state for ``rollout_id`` made from a :meth:`snapshot` handle (a new
        sandbox forked from it): used when :meth:`attach` finds no state at the journaled
        version. The journaled calls after the snapshot are then replayed on it."""
        raise NotImplementedError(f"environment {self.name!r} defines no restore_snapshot()")

    def reconcile(self, state: StateT, effect: InDoubtEffect) -> Reconciled | None:
        """Decide an effect in doubt: its intent was recorded but not its result (the
        process died while ``fn`` ran, or ``fn`` raised). Look it up in the outside system
        by ``effect.key`` (the key ``fn`` was given) and answer
        :meth:`Reconciled.applied` with the result ``fn`` would have returned, or
        :meth:`Reconciled.not_applied` (``fn`` is then called). None (the default: no
        reconcile) fails the episode with one line naming the effect; an effect is never
        made a second time on a guess."""
        return None

    def close(self, state: StateT) -> None:
        """Release what the state holds (a database connection); a no-op by default. For an
        ``external`` environment it releases the handle only: the outside state may be
        attached again by a restore, so closing must not destroy it."""
