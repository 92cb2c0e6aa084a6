"""An environment whose tools take their call's context and take their time, for the tool-call tests.

Owns :class:`WaitingEnvironment`: a list of notes per episode (its exported state) and an
*outside log* on the instance, where every tool run appends what its context said (the
idempotency key, rollout, attempt, task, turn, call index) — the stand-in for a system
outside the state, which sees a tool run however often it runs. Tools:

- ``note`` (sync, on the loop, takes the context): appends a note;
- ``count`` (sync, the two-argument form every older tool has): the number of notes;
- ``wait`` (:func:`slow_tool`, in a worker thread): notes ``waiting``, blocks until the
  test sets :attr:`WaitingEnvironment.release` or ``seconds`` pass, then notes ``waited``
  (a state half-changed while it blocks);
- ``await_for`` (``async def``): sleeps ``seconds`` on the loop's clock, then notes;
- ``block`` (sync, unmarked): sleeps ``seconds`` wherever it runs (the measured threshold).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import JsonValue

from rollpoint.envs import (
    CheckpointMode,
    Environment,
    TaskRow,
    Tool,
    ToolArguments,
    ToolContext,
    VerifyReply,
    slow_tool,
)
from rollpoint.envs.base import NoArguments


class NoteArgs(ToolArguments):
    text: str


class WaitArgs(ToolArguments):
    seconds: float


@dataclass
class Notes:
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Seen:
    """One tool run as the outside log keeps it."""

    tool: str
    key: str
    rollout_id: str
    attempt: int
    task_id: str
    turn: int
    call_index: int
    thread: str


class WaitingEnvironment(Environment[Notes]):
    name: ClassVar[str] = "waiting"
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.TURN

    def __init__(self) -> None:
        self.outside: list[Seen] = []
        """Every tool run, appended by the tool itself (from whichever thread ran it)."""
        self.release = threading.Event()
        """Set: a ``wait`` running or to come returns at once."""
        self.running = 0
        """``wait`` calls running now."""
        self.closed: list[int] = []
        """``id()`` of every state closed, in order."""
        self._lock = threading.Lock()
        self._tools: dict[str, Tool[Notes, Any]] = {
            t.name: t
            for t in (
                Tool("note", "Add a note.", NoteArgs, self._note),
                Tool("count", "How many notes.", NoArguments, _count),
                Tool("wait", "Wait, then add a note.", WaitArgs, self._wait),
                Tool("await_for", "Wait asynchronously, then note.", WaitArgs, self._await_for),
                Tool("block", "Block, then add a note.", WaitArgs, self._block),
            )
        }

    def _seen(self, ctx: ToolContext) -> None:
        seen = Seen(
            ctx.tool,
            ctx.idempotency_key,
            ctx.rollout_id,
            ctx.attempt,
            ctx.task_id,
            ctx.turn,
            ctx.call_index,
            threading.current_thread().name,
        )
        with self._lock:
            self.outside.append(seen)

    def _note(self, state: Notes, args: NoteArgs, ctx: ToolContext) -> str:
        self._seen(ctx)
        ctx.logger.info("noting %s", args.text)
        state.notes.append(args.text)
        return f"noted {args.text}"

    @slow_tool
    def _wait(self, state: Notes, args: WaitArgs, ctx: ToolContext) -> str:
        with self._lock:
            self.running += 1
        try:
            self._seen(ctx)
            state.notes.append("waiting")
            self.release.wait(args.seconds)
            state.notes.append("waited")
            return "waited"
        finally:
            with self._lock:
                self.running -= 1

    async def _await_for(self, state: Notes, args: WaitArgs, ctx: ToolContext) -> str:
        self._seen(ctx)
        await asyncio.sleep(args.seconds)
        state.notes.append("awaited")
        return "awaited"

    def _block(self, state: Notes, args: WaitArgs, ctx: ToolContext) -> str:
        self._seen(ctx)
        time.sleep(args.seconds)
        state.notes.append("blocked")
        return "blocked"

    def tool_table(self) -> Mapping[str, Tool[Notes, Any]]:
        return self._tools

    def _make_task(self, index: int, rng: random.Random) -> TaskRow:
        return TaskRow(task_id=self.task_id(index), environment=self.name, prompt="wait")

    def start(self, task: TaskRow) -> Notes:
        return Notes()

    def verify(self, state: Notes, task: TaskRow, final_message: str | None) -> VerifyReply:
        return VerifyReply(reward=1.0, detail={"notes": len(state.notes)})

    def close(self, state: Notes) -> None:
        self.closed.append(id(state))

    def export_state(self, state: Notes) -> dict[str, JsonValue]:
        return {"notes": list(state.notes)}

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> Notes:
        return Notes(list(exported["notes"]))


def _count(state: Notes, args: NoArguments) -> str:
    return str(len(state.notes))


class OffloadingEnvironment(WaitingEnvironment):
    """The same tools, in an environment that lets a measured slow tool move to a thread."""

    name: ClassVar[str] = "offloading"
    offload_slow_tools: ClassVar[bool] = True
