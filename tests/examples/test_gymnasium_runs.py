"""examples/gymnasium.yaml as its user would run it, on FrozenLake and Taxi: SIGKILLed
mid-episode, rerun to the end, and checked from the environment's own state.

The scripted policy plays random actions through ``gym_step`` until the episode ends.
Each resources server logs the exported state of every episode it verifies
(``final_states_log``): the seed, every action the Gymnasium env took with what it
answered, how many actions restores replayed and how many replays diverged. Held to:

- every row trained exactly once (I1, from ``train_data.jsonl``);
- nothing happened twice, nothing was lost: the actions the env took are exactly the
  successful ``gym_step`` calls of the trained transcript, in order, and each step's
  ``[observation, reward, terminated, truncated]`` is the one the transcript's result shows;
- every continued episode continued at its turn: its env had been rebuilt by replaying the
  actions taken before the kill (``replayed`` > 0), with no divergence (both environments
  are deterministic from their seed); a divergence would have to show in the transcript
  as the env's notice (reported restart).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from rollpoint.envs import get_environment
from rollpoint.servers.resources.final_state_log import read_final_states
from rollpoint.testing import invariants
from tests.support.run_dir import has_checkpoint, newest_holds_depth, published
from tests.support.run_process import Finished, RunProcess

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]  # two runs, each ~20 s alone

EXAMPLE = Path(__file__).parents[2] / "examples" / "gymnasium.yaml"
TASKS, GROUP_SIZE, MAX_RERUNS = 12, 2, 3
_CONTINUED = re.compile(r"(\d+)\s+episodes\s+continued")


def write_config(tmp_path: Path, environment: str) -> Path:
    config: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    config.update(
        workdir=str(tmp_path / "run"),
        environment=environment,
        tasks=TASKS,
        group_size=GROUP_SIZE,
        final_states_log=str(tmp_path / "final"),
        # 120 ms a policy call: an episode lives across several 0.3 s snapshots.
        policy={**config["policy"], "latency_ms": 120},
        snapshot={"every_seconds": 0.3},
        train={"batch_size": 4},
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def steps_called(messages: list[dict[str, Any]]) -> list[tuple[Any, list[Any], str | None]]:
    """Each successful gym_step call of a transcript: its action, the
    ``[observation, reward, terminated, truncated]`` its result showed, and its notice."""
    results = {m.get("tool_call_id"): m.get("content") for m in messages if m["role"] == "tool"}
    steps = []
    for message in messages:
        for call in message.get("tool_calls") or ():
            if call["function"]["name"] != "gym_step":
                continue
            content = str(results.get(call["id"]))
            if content.startswith("error"):
                continue
            reply = orjson.loads(content)
            action = orjson.loads(call["function"]["arguments"])["action"]
            entry = [reply["observation"], reply["reward"], reply["terminated"], reply["truncated"]]
            steps.append((action, entry, reply.get("notice")))
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


def _rerun_until_ok(config: Path, started: list[RunProcess]) -> list[Finished]:
    runs: list[Finished] = []
    while len(runs) < MAX_RERUNS:
        started.append(RunProcess(config))
        runs.append(started[-1].finish(timeout_s=240))
        if runs[-1].returncode == 0:
            return runs
        assert "Traceback" not in runs[-1].stderr, runs[-1].stderr[-3000:]
    raise AssertionError("reruns failed:\n" + "\n---\n".join(r.stderr[-1500:] for r in runs))


@pytest.mark.parametrize("environment", ["gymnasium:FrozenLake-v1", "gymnasium:Taxi-v4"])
def test_sigkill_mid_episode_then_rerun_replays_every_episode_to_its_turn_and_steps_once(
    tmp_path: Path, environment: str, record_property: Any
) -> None:
    config = write_config(tmp_path, environment)
    workdir = tmp_path / "run"
    store = workdir / invariants.SNAPSHOT_STORE_DIR
    started: list[RunProcess] = []
    try:
        run = RunProcess(config)
        started.append(run)
        run.wait_until(lambda: has_checkpoint(workdir), "a train checkpoint")
        before = published(store)
        run.wait_until(
            # Two actions taken and a call left: the rerun replays them and goes on.
            lambda: newest_holds_depth(store, before, 2, most=15),
            "a snapshot after it holding an episode 2 turns in",
        )
        assert run.proc.poll() is None, f"the run ended before the kill:\n{run.stderr[-2000:]}"
        assert run.kill() == [], "processes outlived the killed run"
        reruns = _rerun_until_ok(config, started)
    finally:
        for proc in started:
            if proc.proc.poll() is None:
                proc.kill()

    match = _CONTINUED.search(reruns[0].stderr)
    assert match and int(match.group(1)) > 0, reruns[0].stderr[-2000:]
    tasks = get_environment(environment).make_tasks(TASKS, 0)
    rollouts, unreadable = invariants.read_train_data(workdir)
    found = [
        *unreadable,
        *invariants.check_exactly_once(rollouts, invariants.expected_rows(tasks, GROUP_SIZE)),
    ]
    assert found == [], invariants.report(found)

    states, problems = read_final_states(tmp_path / "final")
    assert problems == []
    replayed = divergences = continued = steps = 0
    for r in rollouts:
        entry = states.get((r.rollout_id, r.attempt))
        assert entry is not None, f"{r.subject}: no final state logged"
        state = entry.state
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
        before_cut = r.model_calls is not None and any(c.attempt < r.attempt for c in r.model_calls)
        if r.attempt >= 1 and before_cut and len(state["actions"]) > 0:
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
