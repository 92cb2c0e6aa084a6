"""The ``nemo-gym:`` adapter against a server speaking NeMo-Gym's resources-server wire.

NeMo-Gym needs Python 3.12 or later and cannot be imported here, so the server is the
stand-in :mod:`rollpoint.testing.nemo_gym_counter` (NeMo-Gym's stateful counter, its routes
and bodies as recorded in ``tests/fixtures/nemo_gym``), a real process on loopback. What it
applied, per session, is read from its own log.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollpoint.envs import get_environment
from rollpoint.envs.nemo_gym_env import NemoGymEnvironment, NemoGymEpisode
from rollpoint.protocol.errors import ConfigError, InvalidCheckpointStateError, ToolArgumentError
from tests.support.nemo_gym_stand_in import ROWS, counter_server, server_log

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nemo_gym"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with counter_server() as served:
        yield served


@pytest.fixture(scope="module")
def env(url: str) -> NemoGymEnvironment:
    made = get_environment(f"nemo-gym:{url}@{ROWS}")
    assert isinstance(made, NemoGymEnvironment)
    return made


def call(env: NemoGymEnvironment, state: NemoGymEpisode, tool: str, **args: Any) -> str:
    return env.call(state, tool, args)


def increments(url: str) -> list[int]:
    """The counts the server applied, in order, all sessions together."""
    return [entry["count"] for entry in server_log(url)["increments"]]


def test_tools_and_tasks_are_the_rows_own(env: NemoGymEnvironment) -> None:
    assert [t["function"]["name"] for t in env.tools()] == [  # type: ignore[index]
        "increment_counter",
        "get_counter_value",
    ]
    task = env.make_tasks(1, 0)[0]
    assert task.prompt == "add 1 then add 2 then get the count"
    assert task.params["row"]["initial_count"] == 3  # type: ignore[index,call-overload]


def test_an_episode_seeds_its_session_calls_the_tool_routes_and_verifies(
    env: NemoGymEnvironment, url: str
) -> None:
    task = env.make_tasks(1, 0)[0]
    state = env.start(task)
    before = len(increments(url))
    assert json.loads(call(env, state, "increment_counter", count=1)) == {"success": True}
    assert json.loads(call(env, state, "increment_counter", count=2)) == {"success": True}
    assert json.loads(call(env, state, "get_counter_value")) == {"count": 6}
    assert increments(url)[before:] == [1, 2]
    reply = env.verify(state, task, "The count is 6.")
    assert reply.reward == 1.0 and reply.detail["calls"] == 3
    env.close(state)


def test_the_verify_body_has_the_recorded_shape(env: NemoGymEnvironment) -> None:
    recorded = json.loads((FIXTURES / "counter_verify_response.json").read_text())
    task = env.make_tasks(1, 0)[0]
    state = env.start(task)
    call(env, state, "increment_counter", count=1)
    response = env.response(state, "done")
    kinds = {item["type"]: set(item) for item in recorded["response"]["output"]}
    for item in response["output"]:  # type: ignore[union-attr]
        assert set(item) <= kinds[item["type"]] | {"annotations"}, item  # type: ignore[index,arg-type]
    assert {"id", "created_at", "model", "object", "output"} <= set(response)
    # NeMo-Gym's verify response keeps only its base fields; the request is the row plus these.
    assert set(recorded) - {"reward"} <= set(task.params["row"]) | {"response"}  # type: ignore[arg-type]
    env.close(state)


def test_arguments_the_server_refuses_are_the_models_error_and_no_step(
    env: NemoGymEnvironment, url: str
) -> None:
    state = env.start(env.make_tasks(1, 0)[0])
    before = increments(url)
    with pytest.raises(ToolArgumentError, match="increment_counter: 422"):
        call(env, state, "increment_counter", count="two")
    assert state.calls == [] and increments(url) == before
    env.close(state)


def test_restore_replays_the_calls_on_a_new_session_and_the_episode_goes_on(
    env: NemoGymEnvironment, url: str
) -> None:
    task = env.make_tasks(1, 0)[0]
    state = env.start(task)
    call(env, state, "increment_counter", count=1)
    saved = json.loads(json.dumps(env.export_state(state)))
    sessions_before = set(server_log(url)["counters"])

    restored = env.restore_state(task, saved)
    log = server_log(url)
    (new,) = set(log["counters"]) - sessions_before
    assert [e["count"] for e in log["increments"] if e["session"] == new] == [1]
    assert (restored.replayed, restored.restarts) == (1, 0)
    call(env, restored, "increment_counter", count=2)
    assert json.loads(call(env, restored, "get_counter_value")) == {"count": 6}
    assert env.verify(restored, task, "6").reward == 1.0
    env.close(state)
    env.close(restored)


def test_a_replay_answered_otherwise_restarts_the_episode_and_says_so(
    env: NemoGymEnvironment,
) -> None:
    task = env.make_tasks(1, 0)[0]
    state = env.start(task)
    call(env, state, "get_counter_value")
    saved = env.export_state(state)
    saved["calls"][0][2] = '{"count":99}'  # type: ignore[index]
    restored = env.restore_state(task, saved)
    assert (restored.calls, restored.restarts) == ([], 1)
    assert "restarted" in call(env, restored, "get_counter_value")
    assert env.verify(restored, task, None).detail["restarts"] == 1
    env.close(state)
    env.close(restored)


def test_restart_mode_seeds_a_fresh_session_and_reports_it(url: str) -> None:
    env = get_environment(f"nemo-gym:{url}@{ROWS}@restart")
    task = env.make_tasks(1, 0)[0]
    state = env.start(task)
    call(env, state, "increment_counter", count=5)
    restored = env.restore_state(task, env.export_state(state))
    assert (restored.calls, restored.restarts, restored.replayed) == ([], 1, 0)
    assert json.loads(call(env, restored, "get_counter_value").split("\n\n")[0]) == {"count": 3}
    env.close(state)
    env.close(restored)


def test_a_malformed_saved_state_is_refused_in_one_line(env: NemoGymEnvironment) -> None:
    task = env.make_tasks(1, 0)[0]
    with pytest.raises(InvalidCheckpointStateError, match="'calls'"):
        env.restore_state(task, {"calls": 3, "replayed": 0, "restarts": 0})


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("nemo-gym:localhost", "want nemo-gym:http://host:port@<rows.jsonl>"),
        ("nemo-gym:http://127.0.0.1:9", "want nemo-gym:http://host:port@<rows.jsonl>"),
        ("nemo-gym:http://127.0.0.1:9@rows.jsonl;x=1", "want nemo-gym:"),
        ("nemo-gym:http://127.0.0.1:9@/no/such/rows.jsonl", "cannot read tasks file"),
        (f"nemo-gym:http://127.0.0.1:9@{ROWS}@later", "optionally followed by @replay"),
    ],
)
def test_a_bad_reference_is_one_config_error(ref: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        get_environment(ref)
