"""examples/gymnasium.yaml as its user would run it (FrozenLake): SIGKILLed mid-episode,
rerun to the end, and checked from the environment's own state. Taxi, which the example
names as its other environment, goes through the same adapter; its save and replay are
tested in process (tests/unit/envs/test_gymnasium_env.py).

The scripted policy plays random actions through ``gym_step`` until the episode ends.
Each resources server logs the exported state of every episode it verifies
(``final_states_log``): the seed, every action the Gymnasium env took with what it
answered, how many actions restores replayed and how many replays diverged. Held to:

- every row trained exactly once (I1, from ``train_data.jsonl``);
- nothing happened twice, nothing was lost: the actions the env took are exactly the
  successful ``gym_step`` calls of the trained transcript, in order, and each step's
  ``[observation, reward, terminated, truncated]`` is the one the transcript's result shows;
- every continued episode continued at its turn: its env had been rebuilt by replaying the
  actions taken before the kill (``replayed`` > 0), with no divergence (the environment is
  deterministic from its seed); a divergence would have to show in the transcript
  as the env's notice (reported restart).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.envs import get_environment
from tests.support.crash_rerun import (
    crash_and_rerun,
    final_state_of,
    final_states,
    held_at_the_restore,
    tool_calls,
    trained_once,
    write_example_config,
)

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]  # two runs, each ~20 s alone

EXAMPLE = Path(__file__).parents[2] / "examples" / "gymnasium.yaml"
TASKS, GROUP_SIZE = 12, 2


def write_config(tmp_path: Path, environment: str) -> Path:
    return write_example_config(
        tmp_path,
        EXAMPLE,
        environment=environment,
        tasks=TASKS,
        group_size=GROUP_SIZE,
        # 120 ms a policy call: an episode lives across several 0.3 s snapshots.
        policy={"latency_ms": 120},
        snapshot={"every_seconds": 0.3},
        train={"batch_size": 4},
    )


def steps_called(messages: list[dict[str, Any]]) -> list[tuple[Any, list[Any], str | None]]:
    """Each successful gym_step call of a transcript: its action, the
    ``[observation, reward, terminated, truncated]`` its result showed, and its notice."""
    steps = []
    for call in tool_calls(messages):
        if call.name != "gym_step" or call.failed:
            continue
        reply = orjson.loads(call.result)
        entry = [reply["observation"], reply["reward"], reply["terminated"], reply["truncated"]]
        steps.append((call.arguments["action"], entry, reply.get("notice")))
    return steps


def replay(env_id: str, seed: int, actions: list[Any]) -> list[list[Any]]:
    """What Gymnasium itself answers to ``actions`` from ``seed``, step by step."""
    import gymnasium as gym

    env = gym.make(env_id)
    try:
        env.reset(seed=seed)
        out = []
        for action in actions:
            observation, reward, terminated, truncated, _ = env.step(action)
            out.append([int(observation), reward, terminated, truncated])
        return out
    finally:
        env.close()


@pytest.mark.parametrize("environment", ["gymnasium:FrozenLake-v1"])
def test_sigkill_mid_episode_then_rerun_replays_every_episode_to_its_turn_and_steps_once(
    tmp_path: Path, environment: str, record_property: Any
) -> None:
    config = write_config(tmp_path, environment)
    # Two actions taken and a call left: the rerun replays them and goes on.
    crash_and_rerun(config, tmp_path / "run", depth=2, most=15)
    tasks = get_environment(environment).make_tasks(TASKS, 0)
    rollouts = trained_once(tmp_path / "run", tasks, GROUP_SIZE)
    states = final_states(tmp_path / "final")
    replayed = divergences = continued = steps = 0
    for r in rollouts:
        state = final_state_of(states, r)
        called = steps_called(r.messages)
        notices = [n for _, _, n in called if n is not None]
        # After a reported restart the env holds only the steps since; none happened here.
        assert len(notices) == state["restarts"], f"{r.subject}: a restart went unreported"
        since = max((i for i, (_, _, n) in enumerate(called) if n is not None), default=0)
        kept = called[since:]
        assert state["actions"] == [a for a, _, _ in kept], (
            f"{r.subject}: the env took {state['actions']}, the transcript's calls"
            f" {[a for a, _, _ in kept]}"
        )
        assert state["trace"] == [e for _, e, _ in kept], f"{r.subject}: a step answered otherwise"
        # And the episode is the one its seed and actions make: a restore that lost the
        # env's progress (or stepped an action twice) answers otherwise from there on.
        env_id = environment.removeprefix("gymnasium:")
        assert state["trace"] == replay(env_id, state["seed"], state["actions"]), (
            f"{r.subject}: the steps are not what {env_id} answers to its actions from its seed"
        )
        replayed += state["replayed"]
        divergences += state["restarts"]
        steps += len(state["actions"])
        # Steps the restored env held must have been replayed (a continued try whose
        # held turns took no step, or whose one kept reply ran its step after the
        # restore, had nothing to replay).
        held = [c for c in held_at_the_restore(r) if c.name == "gym_step" and not c.failed]
        if held:
            continued += 1
            assert state["replayed"] > 0 or state["restarts"] > 0, (
                f"{r.subject}: continued, yet its env was not rebuilt by replay"
            )
    record_property("replayed_actions", replayed)
    record_property("divergences", divergences)
    print(
        f"{environment}: {steps} steps, {continued} continued episodes,"
        f" {replayed} actions replayed, {divergences} divergences"
    )
    assert continued > 0, "no episode continued with actions from before the kill"
    assert replayed > 0
    assert divergences == 0, "a deterministic environment's replay diverged"
