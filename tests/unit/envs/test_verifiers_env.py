"""``verifiers:<module>[:<attr>]``: a verifiers MultiTurnEnv behind ``vf_respond``, its state
saved as JSON (refused, naming the key, when it is not), its rubric as verify.

The published environment is staros-stardata's Constraint Gym (a SingleTurnEnv from PyPI);
the multi-turn path is also held to a small MultiTurnEnv of this file (``countdown``), and the
refusal to verifiers' own GymEnv, which keeps a live Gymnasium env in its state."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import orjson
import pytest
import verifiers as vf
from datasets import Dataset

from rollpoint.envs import (
    ConfigError,
    EpisodeError,
    InvalidCheckpointStateError,
    ToolArgumentError,
    get_environment,
    resolve_environment,
)
from rollpoint.envs.verifiers_env import VerifiersEnvironment

STARDATA = "verifiers:stardata.envs.constraint_gym"
COUNTDOWN = "verifiers:tests.unit.envs.test_verifiers_env:countdown"
HAIKU = "An old light turns\nthe keeper climbs down at dawn\nwaves keep their own time"


def _content(message: Any) -> str:
    return str(message.get("content") if isinstance(message, dict) else message.content)


class Countdown(vf.MultiTurnEnv):
    """Three replies; the environment counts down after each and notes what it heard."""

    async def setup_state(self, state: vf.State, **kwargs: Any) -> vf.State:
        state["left"], state["heard"], state["env_turns"] = 3, [], 0
        return state

    async def env_response(
        self, messages: vf.Messages, state: vf.State, **kwargs: Any
    ) -> vf.Messages:
        state["env_turns"] += 1
        state["heard"].append(_content(messages[-1]))
        state["left"] -= 1
        if state["left"] == 0:
            state["final_env_response"] = [vf.UserMessage(content="lift off")]
            return state["final_env_response"]
        return [vf.UserMessage(content=f"{state['left']} to go")]


def heard_three(state: vf.State, **kwargs: Any) -> float:
    return 1.0 if len(state["heard"]) == 3 else 0.0


def countdown() -> Countdown:
    rows = [{"question": "Count down with me.", "answer": "3"}]
    return Countdown(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[heard_three]))


def make(ref: str) -> VerifiersEnvironment:
    env = get_environment(ref)
    assert isinstance(env, VerifiersEnvironment)
    return env


def through_json(value: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = orjson.loads(orjson.dumps(value))
    return loaded


def test_a_published_environment_resolves_and_its_dataset_rows_are_the_tasks() -> None:
    cls = resolve_environment(STARDATA)
    assert cls is resolve_environment(STARDATA) and cls.name == STARDATA
    env = make(STARDATA)
    tasks = env.make_tasks(40, 0)
    assert tasks[1].task_id == "stardata_envs_constraint_gym-0001"
    assert tasks[1].prompt.startswith("Write a haiku") and tasks[1].environment == STARDATA
    assert tasks[1].params["input"]["answer"]["form"] == "haiku"  # type: ignore[index,call-overload]
    assert tasks[36].params == tasks[0].params  # 36 rows, wrapping around


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("verifiers:no_such_vf_env", "cannot import module 'no_such_vf_env'"),
        ("verifiers:json:nope", "module 'json' has no attribute 'nope'"),
        ("verifiers:json:dumps", "json:dumps() failed (TypeError"),
        ("verifiers:os:getcwd", "os:getcwd gave a str, not a verifiers MultiTurnEnv"),
        ("verifiers:a:b:c", "want verifiers:<module> or verifiers:<module>:<attr>"),
    ],
)
def test_a_bad_reference_is_one_config_error_naming_it(ref: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_environment(ref)
    assert message in err.value.message and err.value.message.startswith(f"environment {ref!r}")


def test_loading_keeps_the_processes_signal_handlers() -> None:
    def mine(signum: int, frame: object) -> None:
        """A stand-in for the server's graceful stop."""

    before = signal.signal(signal.SIGTERM, mine)
    try:
        make(STARDATA)  # verifiers sets SIGTERM to "tear down, exit 143" when it is made
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_single_turn_environment_ends_after_one_reply_and_its_rubric_scores_it() -> None:
    env = make(STARDATA)
    task = env.make_tasks(2, 0)[1]
    episode = env.start(task)
    assert env.call(episode, "vf_respond", {"content": HAIKU}).startswith(
        "The episode is over (max_turns_reached)"
    )
    with pytest.raises(ToolArgumentError, match="the episode is over"):
        env.call(episode, "vf_respond", {"content": "again"})
    verdict = env.verify(episode, task, "That is my poem.")
    assert 0.0 < verdict.reward < 1.0
    assert verdict.detail["stop_condition"] == "max_turns_reached" and verdict.detail["turns"] == 1
    assert verdict.detail["metrics"]["prosody_reward"] == verdict.reward


@pytest.mark.parametrize(
    "reply",
    [
        HAIKU,
        # The crash test's scripted reply whose trained reward (the package's score of the
        # message list's repr, 0.3625) was not the package's score of the reply (0.504).
        "9m605w0wa8",
    ],
)
def test_the_rubric_scores_what_the_policy_said(reply: str) -> None:
    from stardata.envs.constraint_gym import prosody_reward

    env = make(STARDATA)
    task = env.make_tasks(2, 0)[0]
    info = task.params["input"]["info"]  # type: ignore[index,call-overload]
    said, restored = env.start(task), env.restore_state(task, env.export_state(env.start(task)))
    env.call(said, "vf_respond", {"content": reply})
    env.call(restored, "vf_respond", {"content": reply})
    want = min(1.0, prosody_reward(reply, info=info))
    assert env.verify(said, task, None).reward == want
    assert env.verify(restored, task, None).reward == want
    # verify leaves the state's messages as verifiers made them
    assert all(isinstance(m, vf.AssistantMessage) for m in said.state["completion"])


def by_attribute(completion: vf.Messages, **kwargs: Any) -> float:
    return 1.0 if completion[-1].content == "lift off" else 0.0


def by_key(completion: vf.Messages, prompt: vf.Messages, **kwargs: Any) -> float:
    plain = all(isinstance(m, dict) for m in [*completion, *prompt])
    return 1.0 if plain and completion[-1]["content"] == "lift off" else 0.0


def countdown_read_both_ways() -> Countdown:
    env = countdown()
    env.rubric = vf.Rubric(funcs=[by_attribute, by_key], weights=[0.5, 0.5])
    return env


def test_a_reward_function_reads_messages_as_dicts_or_by_attribute() -> None:
    env = make("verifiers:tests.unit.envs.test_verifiers_env:countdown_read_both_ways")
    task = env.make_tasks(1, 0)[0]
    episode = env.start(task)
    for word in ("three", "two", "one"):
        env.call(episode, "vf_respond", {"content": word})
    verdict = env.verify(episode, task, None)
    assert verdict.detail["metrics"] == {"by_attribute": 1.0, "by_key": 1.0}
    assert verdict.reward == 1.0


def test_a_final_answer_alone_is_the_single_turn() -> None:
    env = make(STARDATA)
    task = env.make_tasks(2, 0)[1]
    by_tool, by_answer = env.start(task), env.start(task)
    env.call(by_tool, "vf_respond", {"content": HAIKU})
    assert env.verify(by_answer, task, HAIKU).reward == env.verify(by_tool, task, None).reward


def test_a_saved_single_turn_episode_restores_and_scores_the_same() -> None:
    env = make(STARDATA)
    task = env.make_tasks(2, 0)[1]
    episode = env.start(task)
    env.call(episode, "vf_respond", {"content": HAIKU})
    saved = through_json(env.export_state(episode))
    assert [s["completion"][0]["content"] for s in saved["trajectory"]] == [HAIKU]
    restored = env.restore_state(task, saved)
    assert env.export_state(restored) == saved
    assert env.verify(restored, task, None).reward == env.verify(episode, task, None).reward


def test_a_multi_turn_episode_saved_mid_way_continues_with_the_environments_own_state() -> None:
    env = make(COUNTDOWN)
    task = env.make_tasks(1, 0)[0]
    original, interrupted = env.start(task), env.start(task)
    assert env.call(interrupted, "vf_respond", {"content": "three"}) == "2 to go"
    env.call(original, "vf_respond", {"content": "three"})
    saved = through_json(env.export_state(interrupted))
    assert saved["state"]["heard"] == ["three"] and saved["state"]["env_turns"] == 1
    restored = env.restore_state(task, saved)
    for word in ("two", "one"):
        assert env.call(restored, "vf_respond", {"content": word}) == env.call(
            original, "vf_respond", {"content": word}
        )
    # env_response ran once a turn: the restore replayed nothing of it.
    assert restored.state["env_turns"] == 3 and restored.state["heard"] == ["three", "two", "one"]
    assert env.export_state(restored) == env.export_state(original)
    assert env.verify(restored, task, None).reward == 1.0


def test_the_last_reply_says_the_episode_is_over() -> None:
    env = make(COUNTDOWN)
    episode = env.start(env.make_tasks(1, 0)[0])
    for word in ("three", "two"):
        env.call(episode, "vf_respond", {"content": word})
    assert env.call(episode, "vf_respond", {"content": "one"}).startswith("lift off\n\nThe episode")
    with pytest.raises(ToolArgumentError, match="has_final_env_response"):
        env.call(episode, "vf_respond", {"content": "zero"})


def frozen_lake_gym_env() -> Any:
    """verifiers' own GymEnv (shipped in its package) over Gymnasium's FrozenLake."""
    import gymnasium as gym
    from verifiers.envs.experimental.gym_env import GymEnv

    return GymEnv(
        env_cls=lambda: gym.make("FrozenLake-v1"),  # type: ignore[arg-type]
        action_parser=int,
        num_train_episodes=2,
        num_eval_episodes=0,
    )


def test_a_state_key_that_is_not_json_refuses_the_save_naming_it() -> None:
    env = make("verifiers:tests.unit.envs.test_verifiers_env:frozen_lake_gym_env")
    task = env.make_tasks(1, 0)[0]
    episode = env.start(task)
    env.call(episode, "vf_respond", {"content": "1"})  # GymEnv makes its env at its first turn
    made = env.capture_state(episode)  # in a checkpoint's pause: no error there
    with pytest.raises(EpisodeError) as err:
        made()  # the snapshot's writer packing it: the server names the rollout
    assert err.value.message == (
        f"environment {env.name!r}: state key 'gym_env' holds a TimeLimit, which is not"
        " JSON-able: this episode cannot be saved (keep JSON values in the state)"
    )


def test_a_malformed_save_is_refused() -> None:
    env = make(STARDATA)
    task = env.make_tasks(1, 0)[0]
    with pytest.raises(InvalidCheckpointStateError, match=r"want \{messages"):
        env.restore_state(task, {"messages": []})
    saved = through_json(env.export_state(env.start(task)))
    saved["trajectory"] = [{"prompt_len": 1}]
    with pytest.raises(InvalidCheckpointStateError, match="bad trajectory or messages"):
        env.restore_state(task, saved)


async def test_the_refusal_fails_that_snapshot_naming_the_rollout(tmp_path: Path) -> None:
    from rollpoint.protocol.episode import EpisodeStart, ToolCall
    from rollpoint.protocol.ids import EpisodeId
    from rollpoint.servers.resources.episode_service import ResourcesService
    from rollpoint.servers.resources.resources_participant import ResourcesParticipant
    from rollpoint.store.participant_state import write_participant_state

    env = make("verifiers:tests.unit.envs.test_verifiers_env:frozen_lake_gym_env")
    service = ResourcesService(env)
    episode = EpisodeId(rollout_id="r7", attempt=0)
    await service.start(EpisodeStart(episode=episode, task=env.make_tasks(1, 0)[0]))
    call = ToolCall(episode=episode, turn=0, call_index=0, arguments='{"content": "1"}')
    assert not (await service.call_tool("vf_respond", call)).is_error
    records = await ResourcesParticipant(service).export([episode])
    with pytest.raises(InvalidCheckpointStateError) as err:
        write_participant_state(
            str(tmp_path / "c1"),
            kind="resources",
            instance="resources-replica-0",
            checkpoint_id="c1",
            records=records,
        )
    assert err.value.message == (
        "record 0 cannot be encoded: packed state of rollout r7 could not be made:"
        f" environment {env.name!r}: state key 'gym_env' holds a TimeLimit, which is not"
        " JSON-able: this episode cannot be saved (keep JSON values in the state)"
    )
