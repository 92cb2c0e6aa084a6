"""The environment conformance kit: an environment's own promises, checked in process.

Owns :func:`check_environment` and :func:`environment_conformance_command` (the body of
``rollpoint conformance --environment REF``). For a few of the environment's tasks it plays
an episode of random tool calls (arguments sampled from each tool's schema, as the scripted
policy does, from a fixed seed) through the same :class:`~rollpoint.envs.tool_call.ToolRunner`
and call context the resources server uses, then checks:

- **export/restore** (``turn`` mode): ``restore_state(export_state(s))`` exports equal to
  ``export_state(s)``, after every call (a restore that loses or changes anything makes
  continued episodes differ from the originals);
- **replay**: the same calls run again, as a replay from the journal runs them
  (``replaying()`` True, on the state restored from the episode's start), give the results
  that were recorded, and end in an equal export — what the tool journal relies on to
  rebuild a state after a snapshot;
- **effects and side_effects**: the replay makes no ``ctx.effect`` again (each is answered
  from its record), and ``side_effects`` of the replayed state equals the original's, each
  effect counted once.

``external`` environments get the replay and effect checks only when they can make fresh
state for a task without a rollout (``start``); their export is their version, compared as
such. It does not start servers; the control protocol is checked by the URL form of the
command (:mod:`rollpoint.testing.conformance`).
"""

from __future__ import annotations

import asyncio
import random
import sys
from functools import partial
from typing import Any

import orjson

from rollpoint.envs.base import Environment
from rollpoint.envs.effects import CallEffects, MemoryEffects
from rollpoint.envs.registry import get_environment
from rollpoint.envs.tool_call import ToolRunner, tool_context
from rollpoint.policy.schema_arguments import sample_arguments
from rollpoint.protocol.errors import RollpointError, ToolArgumentError
from rollpoint.protocol.participant import CheckpointMode
from rollpoint.servers.resources.tool_journal import replaying, replaying_calls

__all__ = ["EnvironmentCheck", "check_environment", "environment_conformance_command"]


class EnvironmentCheck:
    """One check's outcome: its name, the task, pass or fail, one line."""

    def __init__(self, name: str, task_id: str, passed: bool, detail: str) -> None:
        self.name, self.task_id, self.passed, self.detail = name, task_id, passed, detail

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name:<14} {self.task_id}: {self.detail}"


def _canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


class _Player:
    """Runs one episode's calls as the resources server would (one runner, one store)."""

    def __init__(
        self, env: Environment[Any], runner: ToolRunner, store: MemoryEffects, rollout_id: str
    ) -> None:
        self.env, self.runner, self.store, self.rollout_id = env, runner, store, rollout_id

    async def call(
        self, state: Any, task_id: str, turn: int, tool: str, args: dict[str, Any]
    ) -> str:
        where: dict[str, Any] = {
            "rollout_id": self.rollout_id,
            "attempt": 0,
            "task_id": task_id,
            "turn": turn,
            "call_index": 0,
        }
        effects = CallEffects(
            self.env,
            state,
            self.store,
            tool=tool,
            loop=asyncio.get_running_loop(),
            counts=self.store.counts,
            replaying=replaying,
            **where,
        )
        context = partial(tool_context, self.env.name, tool, effects=effects, **where)
        try:
            return await self.runner.call(state, tool, args, context)
        except ToolArgumentError as exc:
            return f"error: {exc.message}"


async def _episode(
    env: Environment[Any], task: Any, index: int, calls: int, seed: int
) -> list[EnvironmentCheck]:
    task_id = task.task_id
    rng = random.Random(f"{env.name}/{task_id}/{seed}")
    specs = {name: t.arguments.model_json_schema() for name, t in env.tool_table().items()}
    plan = [
        (name, sample_arguments(specs[name], rng))
        for name in (rng.choice(sorted(specs)) for _ in range(calls if specs else 0))
    ]
    exported = env.checkpoint_mode is CheckpointMode.TURN
    out: list[EnvironmentCheck] = []
    runner = ToolRunner(env)
    store = MemoryEffects()
    player = _Player(env, runner, store, f"conformance{index}")
    try:
        state = env.start(task)
        start = env.export_state(state) if exported else None
        results: list[str] = []
        round_trip: str | None = None
        for turn, (tool, args) in enumerate(plan):
            results.append(await player.call(state, task_id, turn, tool, args))
            if exported and round_trip is None:
                now = env.export_state(state)
                again = env.export_state(env.restore_state(task, now))
                if _canonical(again) != _canonical(now):
                    round_trip = (
                        f"after call {turn} ({tool}) the restored state exports differently"
                    )
        if exported:
            out.append(
                EnvironmentCheck(
                    "export/restore",
                    task_id,
                    round_trip is None,
                    round_trip or f"equal after each of {len(plan)} calls",
                )
            )
        original_effects = env.side_effects(state)
        made = store.counts.made
        replayed = env.restore_state(task, start) if start is not None else env.start(task)
        again_results = []
        with replaying_calls():
            for turn, (tool, args) in enumerate(plan):
                again_results.append(await player.call(replayed, task_id, turn, tool, args))
        differ = [i for i, (a, b) in enumerate(zip(results, again_results, strict=True)) if a != b]
        final_equal = not exported or _canonical(env.export_state(replayed)) == _canonical(
            env.export_state(state)
        )
        out.append(
            EnvironmentCheck(
                "replay",
                task_id,
                not differ and final_equal,
                f"call {differ[0]} ({plan[differ[0]][0]}) gave another result"
                if differ
                else ("same results, same final state" if final_equal else "final states differ"),
            )
        )
        replay_effects = env.side_effects(replayed)
        twice = sorted(k for k, n in replay_effects.items() if n > 1)
        remade = store.counts.made - made
        ok = replay_effects == original_effects and not twice and remade == 0
        detail = (
            f"{sum(original_effects.values())} side effects, each once; no effect made again"
            if ok
            else f"side effects {dict(original_effects)} vs replayed {dict(replay_effects)};"
            f" counted twice: {twice}; effects made again by the replay: {remade}"
        )
        out.append(EnvironmentCheck("side effects", task_id, ok, detail))
        env.close(replayed)
        env.close(state)
    except RollpointError as exc:
        out.append(EnvironmentCheck("episode", task_id, False, exc.message))
    except Exception as exc:  # the environment's own code: reported, not a traceback
        out.append(EnvironmentCheck("episode", task_id, False, f"{type(exc).__name__}: {exc}"))
    finally:
        runner.close()
    return out


def check_environment(
    environment: Environment[Any], *, episodes: int = 3, calls: int = 6, seed: int = 0
) -> list[EnvironmentCheck]:
    """Every check on ``episodes`` of the environment's synthetic tasks."""
    tasks = environment.make_tasks(episodes, seed)

    async def run() -> list[EnvironmentCheck]:
        found: list[EnvironmentCheck] = []
        for index, task in enumerate(tasks):
            found.extend(await _episode(environment, task, index, calls, seed))
        return found

    return asyncio.run(run())


def environment_conformance_command(reference: str, *, episodes: int = 3, calls: int = 6) -> int:
    """``rollpoint conformance --environment REF``: one line per check; 0 when all passed,
    1 when one failed, 2 when the environment cannot be loaded."""
    try:
        env = get_environment(reference)
    except RollpointError as exc:
        sys.stderr.write(f"error: {exc.message}\n")
        return 2
    checks = check_environment(env, episodes=episodes, calls=calls)
    for check in checks:
        sys.stdout.write(check.line() + "\n")
    failed = sum(not c.passed for c in checks)
    sys.stdout.write(f"{len(checks) - failed} passed, {failed} failed ({env.name})\n")
    return 1 if failed else 0
