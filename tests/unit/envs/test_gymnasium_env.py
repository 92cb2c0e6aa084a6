"""``gymnasium:<env id>``: resolution, the gym_step tool, save as seed plus actions, replay
with a divergence check, and the scripted policy playing it to the end."""

from __future__ import annotations

import logging
from typing import Any

import gymnasium as gym
import orjson
import pytest

from rollpoint.envs import (
    ConfigError,
    InvalidCheckpointStateError,
    ToolArgumentError,
    get_environment,
    resolve_environment,
)
from rollpoint.envs.gymnasium_env import GymnasiumEnvironment, GymState
from rollpoint.policy.playbook import FinalDecision, Playbook, ToolCallDecision
from tests.unit.policy.fake_environments import ask, assistant_call, tool_result

FROZEN = "gymnasium:FrozenLake-v1"


def frozen() -> GymnasiumEnvironment:
    env = get_environment(FROZEN)
    assert isinstance(env, GymnasiumEnvironment)
    return env


def step(env: GymnasiumEnvironment, state: GymState, action: Any) -> dict[str, Any]:
    reply: dict[str, Any] = orjson.loads(env.call(state, "gym_step", {"action": action}))
    return reply


def through_json(value: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = orjson.loads(orjson.dumps(value))
    return loaded


def test_the_reference_resolves_to_one_class_named_by_it() -> None:
    cls = resolve_environment(FROZEN)
    assert cls is resolve_environment(FROZEN)
    assert cls.name == FROZEN and issubclass(cls, GymnasiumEnvironment)
    task = frozen().make_tasks(3, 0)[2]
    assert task.environment == FROZEN and task.task_id == "FrozenLake-v1-0002"
    assert "0 = left, 1 = down, 2 = right, 3 = up" in task.prompt
    assert "[S]FFF" in task.prompt and "observation: 0 (one of 16 states)" in task.prompt


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        (
            "gymnasium:NoSuchGame-v0",
            "environment 'gymnasium:NoSuchGame-v0': Environment `NoSuchGame`",
        ),
        ("gymnasium:Taxi-v3", "Please use `Taxi-v4` instead"),
        ("gymnasium:Pendulum-v1", "action space Box is not supported (want Discrete or Text)"),
        ("gymnasium:FrozenLake-v1@os.path:nope", "os.path:nope is not a function"),
        ("gymnasium:FrozenLake-v1@no_such_module_x:f", "cannot import module 'no_such_module_x'"),
        ("gymnasium:", "want gymnasium:<env id>"),
    ],
)
def test_a_bad_reference_is_one_config_error_naming_it(ref: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_environment(ref)
    assert message in err.value.message and "\n" not in err.value.message


def test_the_tool_takes_an_action_within_the_discrete_space() -> None:
    env = frozen()
    (spec,) = env.tools()
    assert spec["function"]["name"] == "gym_step"  # type: ignore[index,call-overload]
    action = spec["function"]["parameters"]["properties"]["action"]  # type: ignore[index,call-overload]
    assert (action["minimum"], action["maximum"], action["type"]) == (0, 3, "integer")  # type: ignore[index]
    state = env.start(env.make_tasks(1, 0)[0])
    with pytest.raises(ToolArgumentError, match="action"):
        env.call(state, "gym_step", {"action": 4})
    assert state.actions == []


@pytest.mark.parametrize("reference", [FROZEN, "gymnasium:Taxi-v4"])
def test_saved_as_seed_and_actions_a_restore_continues_as_the_original_would(
    reference: str,
) -> None:
    env = get_environment(reference)
    assert isinstance(env, GymnasiumEnvironment)
    task = env.make_tasks(2, 0)[1]
    original, interrupted = env.start(task), env.start(task)
    actions = [1, 2, 1, 2, 2, 1, 1, 3]
    for action in actions[:3]:
        step(env, original, action)
        step(env, interrupted, action)
    saved = through_json(env.export_state(interrupted))
    assert saved["actions"] == actions[:3] and saved["replayed"] == 0
    restored = env.restore_state(task, saved)
    for action in actions[3:]:
        if original.done:
            break
        assert step(env, restored, action) == step(env, original, action)
    assert restored.replayed == 3 and restored.restarts == 0
    assert env.export_state(restored)["trace"] == env.export_state(original)["trace"]


def test_a_step_after_the_end_is_refused() -> None:
    env = get_environment("gymnasium:CliffWalking-v1")
    state = env.start(env.make_tasks(1, 0)[0])
    # Up, eleven times right along the cliff's edge, down onto the goal.
    for action in [0] + [1] * 11 + [2]:
        env.call(state, "gym_step", {"action": action})
    assert state.done
    with pytest.raises(ToolArgumentError, match="the episode is over"):
        env.call(state, "gym_step", {"action": 0})
    assert len(state.actions) == 13


def test_a_replay_that_diverges_restarts_the_episode_logs_one_line_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = frozen()
    task = env.make_tasks(2, 0)[1]
    state = env.start(task)
    for action in (1, 2):
        step(env, state, action)
    saved = through_json(env.export_state(state))
    saved["trace"][1][0] = 15  # recorded another observation than the env gives
    with caplog.at_level(logging.WARNING, logger="rollpoint.envs.gymnasium_env"):
        restarted = env.restore_state(task, saved)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"{FROZEN}: task {task.task_id}: replay diverged at action 2 of 2")
    assert "\n" not in line and "the episode restarts from its seed" in line
    assert (restarted.actions, restarted.restarts, restarted.replayed) == ([], 1, 2)
    reply = step(env, restarted, 1)
    assert reply["step"] == 1 and "restarted" in reply["notice"]
    assert "notice" not in step(env, restarted, 2)  # said once
    assert env.verify(restarted, task, None).detail["restarts"] == 1


def test_a_saved_state_that_does_not_fit_the_task_is_refused() -> None:
    env = frozen()
    tasks = env.make_tasks(2, 0)
    state = env.start(tasks[0])
    step(env, state, 1)
    with pytest.raises(InvalidCheckpointStateError, match="does not fit the task"):
        env.restore_state(tasks[1], env.export_state(state))
    with pytest.raises(InvalidCheckpointStateError, match="'actions'"):
        env.restore_state(tasks[0], {**env.export_state(state), "actions": "1"})


def test_a_subclass_sets_make_kwargs_and_the_goal_is_reward_one() -> None:
    # Not slippery: the path down-down-right-right-down-right reaches the goal.
    class Steady(GymnasiumEnvironment):
        name = "steady-lake"
        env_id = "FrozenLake-v1"
        make_kwargs = {"is_slippery": False}
        ansi = True

    steady = Steady()
    task = steady.make_tasks(1, 0)[0]
    state = steady.start(task)
    for action in (1, 1, 2, 2, 1, 2):
        reply = step(steady, state, action)
    assert reply["terminated"] and reply["reward"] == 1
    assert steady.verify(state, task, None).reward == 1.0


def render_position(env: Any, observation: Any) -> str:
    return f"you are on cell {observation}"


def test_a_render_function_named_in_the_reference_makes_the_text() -> None:
    env = get_environment(f"{FROZEN}@tests.unit.envs.test_gymnasium_env:render_position")
    task = env.make_tasks(1, 0)[0]
    assert task.prompt.endswith("The first observation:\nyou are on cell 0")
    state = env.start(task)
    assert step(env, state, 2)["text"].startswith("you are on cell ")


class EchoText(gym.Env[str, str]):
    """A Text action space: the episode ends when the action is 'stop'."""

    action_space = gym.spaces.Text(min_length=1, max_length=8)
    observation_space = gym.spaces.Text(max_length=8)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        return "ready", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return action[::-1], 1.0 if action == "stop" else 0.0, action == "stop", False, {}


def test_a_text_action_space_takes_text_and_replays() -> None:
    gym.register("RollpointEcho-v0", entry_point=EchoText)
    env = get_environment("gymnasium:RollpointEcho-v0")
    action = env.tools()[0]["function"]["parameters"]["properties"]["action"]  # type: ignore[index,call-overload]
    assert action["type"] == "string" and action["maxLength"] == 8  # type: ignore[index]
    task = env.make_tasks(1, 0)[0]
    state = env.start(task)
    assert step(env, state, "abc")["observation"] == "cba"
    restored = env.restore_state(task, through_json(env.export_state(state)))
    assert restored.replayed == 1 and step(env, restored, "stop")["terminated"]
    assert env.verify(restored, task, None).reward == 1.0


def test_the_scripted_policy_steps_until_the_episode_ends() -> None:
    env = frozen()
    task = env.make_tasks(1, 0)[0]
    state = env.start(task)
    playbook = Playbook(seed=0, error_rate=0.0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
    for turn in range(100):
        decision = ask(playbook, messages, env.tools(), seed=7)
        if isinstance(decision, FinalDecision):
            break
        assert isinstance(decision, ToolCallDecision) and decision.name == "gym_step"
        messages.append(assistant_call(f"c{turn}", decision.name, decision.arguments))
        result = env.call(state, "gym_step", orjson.loads(decision.arguments))
        messages.append(tool_result(f"c{turn}", result))
    assert isinstance(decision, FinalDecision) and state.done
    assert decision.text.startswith("The episode terminated after")
    assert len(state.actions) == turn and len(set(state.actions)) > 1
