"""Effects outside an episode's state, made exactly once: what a tool sees of them.

Owns the environment side of ``ctx.effect(name, fn)``: :class:`InDoubtEffect` and
:class:`Reconciled` (what an environment's ``reconcile`` hook is given and answers),
:class:`EffectStore` (what records effects: the resources server's journal, or
:class:`MemoryEffects` where nothing is ever restored), :class:`CallEffects` (the effects
of one tool call, which its :class:`~rollpoint.envs.tool_call.ToolContext` delegates to),
and the rule for effect names.

An *effect* is a change a tool makes outside the episode's state: a line in an external
log, an e-mail, a payment, a ticket. rollpoint cannot export or roll it back, so it makes
it once::

    recorded result of (rollout, turn, call, name)? ─ yes ─▶ that result; fn is not called
            │ no
    intent recorded, no result (in doubt)? ─ yes ─▶ environment.reconcile(state, effect)
            │ no                                      applied(result) ─▶ record it, return it
    record the intent (durable)                       not_applied()   ─▶ go on below
    result = fn(key)                                  None            ─▶ EffectInDoubtError
    record the result (durable) ─▶ result                                (the episode fails)

``key`` is the effect's idempotency key, ``<rollout>/<turn>/<call>/<name>``: the same for
every try of the call, also after a restore under another attempt. Pass it to the outside
system (as payment APIs take an ``Idempotency-Key``) or write it with the effect: that is
what ``reconcile`` looks the effect up by. The window between the intent and the result
(``fn`` ran, or was running, when the process died) is the only one in which rollpoint
cannot know whether the effect was made: it never guesses, it asks ``reconcile``.

Does not own: where records are kept and how they are made durable (the resources server's
:mod:`~rollpoint.servers.resources.effect_records`), nor which thread a tool runs on
(:mod:`rollpoint.envs.tool_call`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from pydantic import JsonValue

from rollpoint.protocol.errors import EffectInDoubtError, EpisodeError

if TYPE_CHECKING:
    from rollpoint.envs.base import Environment

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def check_effect_name(environment: str, name: str) -> None:
    """An effect name is 1-64 characters of letters, digits and ``_.:-`` (it is part of a key)."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ValueError(
            f"environment {environment!r}: effect name {name!r} must be 1-64 letters, digits"
            " or _.:-"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class InDoubtEffect:
    """An effect whose intent was recorded but not its result: ``fn`` may or may not have
    made it. What ``Environment.reconcile`` is asked about."""

    name: str
    key: str
    """The idempotency key ``fn`` was given: look the effect up by it."""
    environment: str
    tool: str
    rollout_id: str
    attempt: int
    """The attempt asking now (the one that recorded the intent may be an earlier one)."""
    task_id: str
    turn: int
    call_index: int


@dataclass(frozen=True, slots=True)
class Reconciled:
    """``reconcile``'s answer: the effect was made (with the result ``fn`` would have
    returned) or it was not (``fn`` is called now). Build with :meth:`applied` or
    :meth:`not_applied`."""

    happened: bool
    result: JsonValue = None

    @classmethod
    def applied(cls, result: JsonValue = None) -> Reconciled:
        return cls(True, result)

    @classmethod
    def not_applied(cls) -> Reconciled:
        return cls(False)


@dataclass(frozen=True, slots=True)
class Recorded:
    """What a store holds of one effect."""

    done: bool
    """A result is recorded (else only the intent: in doubt)."""
    result: JsonValue = None


@dataclass(frozen=True, slots=True)
class EffectCall:
    """Which effect of which call: the store's key."""

    rollout_id: str
    attempt: int
    turn: int
    call_index: int
    name: str
    tool: str

    @property
    def key(self) -> str:
        return f"{self.rollout_id}/{self.turn}/{self.call_index}/{self.name}"


class EffectStore(Protocol):
    """Records effects by ``(rollout, turn, call index, name)``, whatever the attempt.
    Every method is called on the server's event loop."""

    async def find(self, call: EffectCall) -> Recorded | None: ...

    async def intent(self, call: EffectCall) -> None:
        """Record (durably, before returning) that ``fn`` is about to run."""

    async def result(self, call: EffectCall, result: JsonValue, *, reconciled: bool) -> None:
        """Record (durably, before returning) what the effect returned."""


@dataclass
class EffectCounts:
    made: int = 0
    """``fn`` called (the effect made) since this process started."""
    answered: int = 0
    """Answered with a recorded result, ``fn`` not called."""
    reconciled: int = 0
    """In doubt, and ``reconcile`` said it was made."""
    in_doubt: int = 0
    """In doubt with no answer from ``reconcile``: the episode failed."""


@dataclass
class MemoryEffects:
    """Effects recorded in this process only: for servers that never restore (no snapshot
    store) and for :meth:`Environment.call`. A second call of the same key is still
    answered from it; a crash forgets everything, as it forgets the episodes."""

    records: dict[tuple[str, int, int, str], Recorded] = field(default_factory=dict)
    counts: EffectCounts = field(default_factory=EffectCounts)

    @staticmethod
    def _at(call: EffectCall) -> tuple[str, int, int, str]:
        return (call.rollout_id, call.turn, call.call_index, call.name)

    def find_now(self, call: EffectCall) -> Recorded | None:
        return self.records.get(self._at(call))

    def intent_now(self, call: EffectCall) -> None:
        self.records[self._at(call)] = Recorded(False)

    def result_now(self, call: EffectCall, result: JsonValue, *, reconciled: bool) -> None:
        self.records[self._at(call)] = Recorded(True, result)

    async def find(self, call: EffectCall) -> Recorded | None:
        return self.find_now(call)

    async def intent(self, call: EffectCall) -> None:
        self.intent_now(call)

    async def result(self, call: EffectCall, result: JsonValue, *, reconciled: bool) -> None:
        self.result_now(call, result, reconciled=reconciled)


def _json_safe(environment: str, call: EffectCall, value: Any) -> JsonValue:
    try:
        orjson.dumps(value)
    except TypeError as exc:
        raise EpisodeError(
            f"environment {environment!r}: effect {call.name!r} of rollout {call.rollout_id}"
            f" returned a result that is not JSON-safe ({exc}); it is recorded in doubt"
        ) from None
    return value  # type: ignore[no-any-return]


class CallEffects:
    """The effects of one tool call: made by the server for the call, used through the
    call's context (``ctx.effect`` from a synchronous tool in a worker thread,
    ``await ctx.aeffect`` from an ``async def`` tool)."""

    def __init__(
        self,
        environment: Environment[Any],
        state: Any,
        store: EffectStore,
        *,
        rollout_id: str,
        attempt: int,
        task_id: str,
        tool: str,
        turn: int,
        call_index: int,
        loop: asyncio.AbstractEventLoop | None,
        counts: EffectCounts,
        replaying: Callable[[], bool] = lambda: False,
    ) -> None:
        self._environment = environment
        self._state = state
        self._store = store
        self._where = (rollout_id, attempt, task_id, tool, turn, call_index)
        self._loop = loop
        self._counts = counts
        self._replaying = replaying
        self._used: set[str] = set()

    def _call(self, name: str) -> EffectCall:
        env = self._environment.name
        check_effect_name(env, name)
        declared = self._environment.effects
        if name not in declared:
            raise ValueError(
                f"environment {env!r}: effect {name!r} is not declared in its effects"
                f" ({', '.join(sorted(declared)) or 'none'})"
            )
        if name in self._used:
            raise ValueError(
                f"environment {env!r}: effect {name!r} made twice in one call of tool"
                f" {self._where[3]!r}; give each effect of a call its own name"
            )
        self._used.add(name)
        rollout_id, attempt, _, tool, turn, call_index = self._where
        return EffectCall(rollout_id, attempt, turn, call_index, name, tool)

    def _in_doubt(self, call: EffectCall) -> Reconciled:
        rollout_id, attempt, task_id, tool, turn, call_index = self._where
        effect = InDoubtEffect(
            name=call.name,
            key=call.key,
            environment=self._environment.name,
            tool=tool,
            rollout_id=rollout_id,
            attempt=attempt,
            task_id=task_id,
            turn=turn,
            call_index=call_index,
        )
        decided = None if self._replaying() else self._environment.reconcile(self._state, effect)
        if decided is None:
            self._counts.in_doubt += 1
            raise EffectInDoubtError(
                f"environment {self._environment.name!r}: effect {call.name!r} of episode"
                f" {rollout_id}#{attempt} (task {task_id}, turn {turn}, call {call_index}, tool"
                f" {tool!r}) is in doubt: its intent was recorded but not its result, and"
                " reconcile did not decide it; the episode fails rather than make it twice"
            )
        return decided

    def _answer(self, found: Recorded) -> JsonValue:
        self._counts.answered += 1
        return found.result

    def _unrecorded(self, call: EffectCall) -> EffectInDoubtError:
        # A journaled tool call's effects were recorded before it: a replay that finds
        # none would make the effect again, so it stops instead.
        return EffectInDoubtError(
            f"environment {self._environment.name!r}: replaying rollout {call.rollout_id}"
            f" (turn {call.turn}, call {call.call_index}) found no recorded result of effect"
            f" {call.name!r}; it is not made again"
        )

    # ---- from a worker thread (a synchronous tool) -----------------------------------------
    def run(self, name: str, fn: Callable[[str], Any]) -> JsonValue:
        call = self._call(name)
        loop = self._loop
        if loop is None:
            return self._run_here(call, fn)
        if _on_loop(loop):
            raise RuntimeError(
                f"environment {self._environment.name!r}: tool {call.tool!r} called ctx.effect"
                " on the event loop; mark it @slow_tool (it then runs in a worker thread) or"
                " make it async def and await ctx.aeffect"
            )

        def on_loop(coro: Awaitable[Any]) -> Any:
            return asyncio.run_coroutine_threadsafe(coro, loop).result()  # type: ignore[arg-type]

        found = on_loop(self._store.find(call))
        if found is not None and found.done:
            return self._answer(found)
        if self._replaying():
            raise self._unrecorded(call)
        if found is not None:
            decided = self._in_doubt(call)
            if decided.happened:
                on_loop(self._store.result(call, decided.result, reconciled=True))
                self._counts.reconciled += 1
                return decided.result
        else:
            on_loop(self._store.intent(call))
        self._counts.made += 1
        value = _json_safe(self._environment.name, call, fn(call.key))
        on_loop(self._store.result(call, value, reconciled=False))
        return value

    def _run_here(self, call: EffectCall, fn: Callable[[str], Any]) -> JsonValue:
        """No event loop: only an in-memory store (``Environment.call``)."""
        store = self._store
        if not isinstance(store, MemoryEffects):
            raise TypeError("effects recorded in a journal need the server's event loop")
        found = store.find_now(call)
        if found is not None and found.done:
            return self._answer(found)
        if found is not None:
            decided = self._in_doubt(call)
            if decided.happened:
                store.result_now(call, decided.result, reconciled=True)
                return decided.result
        store.intent_now(call)
        self._counts.made += 1
        value = _json_safe(self._environment.name, call, fn(call.key))
        store.result_now(call, value, reconciled=False)
        return value

    # ---- on the event loop (an async def tool) ---------------------------------------------
    async def arun(self, name: str, fn: Callable[[str], Awaitable[Any]]) -> JsonValue:
        call = self._call(name)
        found = await self._store.find(call)
        if found is not None and found.done:
            return self._answer(found)
        if self._replaying():
            raise self._unrecorded(call)
        if found is not None:
            decided = self._in_doubt(call)
            if decided.happened:
                await self._store.result(call, decided.result, reconciled=True)
                self._counts.reconciled += 1
                return decided.result
        else:
            await self._store.intent(call)
        self._counts.made += 1
        value = _json_safe(self._environment.name, call, await fn(call.key))
        await self._store.result(call, value, reconciled=False)
        return value


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs in this thread: a worker thread
        return False
