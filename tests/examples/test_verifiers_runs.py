"""examples/verifiers.yaml as its user would run it: a verifiers environment published on PyPI
(staros-stardata's Constraint Gym), SIGKILLed mid-episode, rerun to the end, and checked from
the environment's own state.

Each resources server logs the exported state of every episode it verifies
(``final_states_log``): the verifiers trajectory, each step the assistant message the
environment got. Held to:

- every row trained exactly once (I1, from ``train_data.jsonl``);
- nothing happened twice, nothing was lost: the environment's trajectory is exactly the
  successful ``vf_respond`` calls of the trained transcript, in order (one for this
  single-turn environment; the calls after it were refused, the episode being over);
- every continued episode continued at its turn: one whose ``vf_respond`` was made before
  the kill (by an earlier attempt) still holds that step after the restore, not a fresh
  state, and the reward the trainer got is the environment's own rubric on that step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from stardata.envs.constraint_gym import prosody_reward

from rollpoint.envs import get_environment
from tests.support.crash_rerun import (
    crash_and_rerun,
    final_state_of,
    final_states,
    tool_calls,
    trained_once,
    write_example_config,
)

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]  # two runs, each ~20 s alone

EXAMPLE = Path(__file__).parents[2] / "examples" / "verifiers.yaml"
TASKS, GROUP_SIZE, TOOL_TURNS = 12, 2, 3


def write_config(tmp_path: Path) -> Path:
    return write_example_config(
        tmp_path,
        EXAMPLE,
        tasks=TASKS,
        group_size=GROUP_SIZE,
        # 120 ms a policy call: an episode (four calls) lives across 0.3 s snapshots.
        policy={"latency_ms": 120, "tool_turns": TOOL_TURNS},
        snapshot={"every_seconds": 0.3},
        train={"batch_size": 4},
    )


def responses(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each successful vf_respond call of a transcript: its content and its call id."""
    return [
        (call.arguments["content"], call.call_id)
        for call in tool_calls(messages)
        if call.name == "vf_respond" and not call.failed
    ]


def test_sigkill_mid_episode_then_rerun_keeps_each_verifiers_turn_once(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    crash_and_rerun(
        config,
        tmp_path / "run",
        # Its reply sent and a policy call left: the rerun goes on from the saved turn.
        depth=1,
        most=TOOL_TURNS,
        checkpoint_timeout_s=120,
    )
    environment = yaml.safe_load(EXAMPLE.read_text())["environment"]
    tasks = {t.task_id: t for t in get_environment(environment).make_tasks(TASKS, 0)}
    rollouts = trained_once(tmp_path / "run", tasks.values(), GROUP_SIZE)
    states = final_states(tmp_path / "final")
    kept_across = 0
    for r in rollouts:
        state = final_state_of(states, r)
        steps = [s["completion"][0]["content"] for s in state["trajectory"]]
        made = responses(r.messages)
        said = [content for content, _ in made]
        final = r.messages[-1].get("content") if r.messages[-1]["role"] == "assistant" else None
        expected = said if said else ([final] if final else [])
        assert steps == expected, (
            f"{r.subject}: the environment got {steps}, the policy said {said}"
        )
        assert len(steps) <= 1, f"{r.subject}: a single-turn environment took {len(steps)} turns"
        if steps:
            info = tasks[r.task_id].params["input"]["info"]  # type: ignore[index,call-overload]
            assert r.reward == pytest.approx(min(1.0, prosody_reward(steps[0], info=info)))
        assert r.model_calls is not None
        by_attempt = {c.turn: c.attempt for c in r.model_calls}
        if r.attempt >= 1 and made and by_attempt.get(0, r.attempt) < r.attempt:
            kept_across += 1  # its reply was made before the kill, and the env still holds it
    print(f"{len(rollouts)} rollouts, {kept_across} continued holding a turn from before the kill")
    assert kept_across > 0, "no continued episode held a turn made before the kill"
