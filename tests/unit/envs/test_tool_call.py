"""Tool calling conventions: found once at load, refused in one line, run where they belong."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest

from rollpoint.envs import ConfigError, NoArguments, Tool, ToolContext, slow_tool
from rollpoint.envs.tool_call import ToolRunner, tool_context
from rollpoint.servers.resources.episode_service import ResourcesService
from tests.support.waiting_env import Notes, OffloadingEnvironment, WaitingEnvironment


def context(tool: str, turn: int = 0, call_index: int = 0) -> ToolContext:
    return tool_context(
        "waiting", tool, rollout_id="r1", attempt=0, task_id="t1", turn=turn, call_index=call_index
    )


def run(runner: ToolRunner, tool: str, arguments: Mapping[str, Any], state: Notes) -> str:
    async def go() -> str:
        return await runner.call(state, tool, arguments, lambda: context(tool))

    return asyncio.run(go())


def test_the_key_is_one_stable_string_of_rollout_turn_and_call_index() -> None:
    ctx = context("note", turn=3, call_index=1)
    assert ctx.idempotency_key == "r1/3/1"
    # The attempt is not part of it: a continued attempt re-sends the same call.
    again = tool_context(
        "waiting", "note", rollout_id="r1", attempt=4, task_id="t1", turn=3, call_index=1
    )
    assert again.idempotency_key == ctx.idempotency_key and again.attempt == 4
    assert context("note", turn=4, call_index=1).idempotency_key != ctx.idempotency_key
    assert context("note", turn=3, call_index=2).idempotency_key != ctx.idempotency_key


def test_the_context_logger_names_the_call(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="rollpoint.envs.waiting"):
        context("note", turn=2, call_index=1).logger.info("hello %s", "there")
    (record,) = caplog.records
    assert record.name == "rollpoint.envs.waiting"
    assert record.getMessage() == "[rollout r1#0 turn 2 call 1 note] hello there"


def test_two_and_three_argument_tools_each_get_what_they_take() -> None:
    env = WaitingEnvironment()
    runner = ToolRunner(env)
    state = Notes()
    assert run(runner, "note", {"text": "a"}, state) == "noted a"
    assert run(runner, "count", {}, state) == "1"  # the two-argument form, unchanged
    assert [s.key for s in env.outside] == ["r1/0/0"]


def test_the_signature_is_read_once_when_the_environment_is_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[object] = []
    real = inspect.signature

    def counting(fn: Any, *args: Any, **kwargs: Any) -> inspect.Signature:
        reads.append(fn)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(inspect, "signature", counting)
    runner = ToolRunner(WaitingEnvironment())
    loaded = len(reads)
    assert loaded == 5  # one per tool
    state = Notes()
    for _ in range(3):
        run(runner, "note", {"text": "x"}, state)
        run(runner, "count", {}, state)
    assert len(reads) == loaded


class _Bad(WaitingEnvironment):
    name: ClassVar[str] = "bad"

    def __init__(self) -> None:
        super().__init__()

        def only_state(state: Notes) -> str:
            return ""

        self._tools = {"broken": Tool("broken", "d", NoArguments, only_state)}  # type: ignore[arg-type]


def test_a_tool_that_fits_no_convention_is_refused_at_load_naming_environment_and_tool() -> None:
    with pytest.raises(ConfigError) as caught:
        ResourcesService(_Bad())
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "environment 'bad': tool 'broken': run must take (state, args) or (state, args, ctx), not "
    )
    assert "only_state(state: 'Notes') -> 'str'" in message


def test_where_each_kind_of_tool_runs() -> None:
    env = WaitingEnvironment()
    runner = ToolRunner(env)
    assert runner.runs_on_loop("note") and runner.runs_on_loop("count")
    assert runner.runs_on_loop("block")  # unmarked: on the loop, only warned about
    assert not runner.runs_on_loop("wait")  # @slow_tool: a worker thread
    assert not runner.runs_on_loop("await_for")  # async def: awaited
    assert runner.runs_on_loop("nope")  # unknown: an error answer, made on the loop
    env.release.set()
    state = Notes()
    run(runner, "wait", {"seconds": 5.0}, state)
    run(runner, "note", {"text": "n"}, state)
    run(runner, "await_for", {"seconds": 0.0}, state)
    here = threading.current_thread().name
    threads = {s.tool: s.thread for s in env.outside}
    assert threads["wait"].startswith("rollpoint-tool") and threads["note"] == here
    assert threads["await_for"] == here
    assert state.notes == ["waiting", "waited", "n", "awaited"]
    runner.close()


def test_a_slow_unmarked_tool_is_warned_about_once_and_stays_on_the_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = WaitingEnvironment()
    runner = ToolRunner(env)
    with caplog.at_level(logging.WARNING, logger="rollpoint.envs.tool_call"):
        run(runner, "block", {"seconds": 0.06}, Notes())
        run(runner, "block", {"seconds": 0.06}, Notes())
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "environment 'waiting': tool 'block' took "
    ) and record.getMessage().endswith(
        "mark it @slow_tool or make it async (see docs/environments.md)"
    )
    assert runner.runs_on_loop("block")
    assert {s.thread for s in env.outside} == {threading.current_thread().name}


def test_with_offload_slow_tools_a_measured_slow_tool_moves_to_a_thread() -> None:
    env = OffloadingEnvironment()
    runner = ToolRunner(env)
    run(runner, "block", {"seconds": 0.0}, Notes())
    assert runner.runs_on_loop("block")  # fast so far
    run(runner, "block", {"seconds": 0.06}, Notes())  # measured over the threshold, on the loop
    assert not runner.runs_on_loop("block")
    run(runner, "block", {"seconds": 0.0}, Notes())
    here = threading.current_thread().name
    assert [s.thread == here for s in env.outside] == [True, True, False]
    runner.close()


def test_slow_tool_marks_the_function_and_returns_it() -> None:
    def tool(state: Notes, args: NoArguments) -> str:
        return ""

    assert slow_tool(tool) is tool
    assert ToolRunner(WaitingEnvironment()).runs_on_loop("note")
