"""Durable turns across a SIGKILL (issue 35's done-when, for the model and resources servers).

A job with journaling on and no periodic snapshot or train checkpoint during the test
(``snapshot.every_seconds: 600``, ``train.checkpoint_every_steps: 1000``: the only snapshot
is the one taken before the first row is sent) is SIGKILLed mid-run, trainer and servers
together, and rerun. The rerun resumes from that first snapshot, so every row is played
again from its prompt under the same rollout id; every call it makes that was finished
before the kill is answered from the journals. Counted from the outside:

- the scripted policy runs as its own process with its own call log (``policy.call_log``);
  with ``seed: turn`` each call's seed names its (rollout, turn), so a key logged before the
  kill and again after it is a policy call done twice: there are at most as many as calls
  were in flight at the kill (at most ``concurrency``, and each among the engine's last
  ``concurrency`` replies before it), where without the journal every call is done again;
- every turn trained carries the token ids and logprobs the engine logged for it;
- the environment's tools also write each effect to a log outside their state
  (``tests.support.effect_log_env``): each effect is there, a journaled one exactly once
  (one in flight at the kill may be there twice: the in-doubt window of issue 36);
- invariants I1 to I4 hold (every row trained once).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.app.config import load_config
from rollpoint.app.job import load_tasks_for
from rollpoint.protocol.token_data import as_float32
from rollpoint.testing import invariants
from tests.chaos.test_crash_recovery import (
    Start,
    continued,
    crash,
    published,
    rerun_until_ok,
    start,
    write_config,
)
from tests.support.effect_log_env import LOG_ENV, EffectLogEnvironment

pytestmark = pytest.mark.chaos
__all__ = ["start"]  # the fixture, shared with the crash tests

CONCURRENCY = 8
TASKS = 24


def lines(path: Path, upto: int | None = None) -> list[Any]:
    if not path.exists():
        return []
    data = path.read_bytes()
    return [orjson.loads(raw) for raw in data[:upto].splitlines()]


NO_SNAPSHOTS: dict[str, Any] = {
    "snapshot": {"every_seconds": 600},
    "train": {"batch_size": 4, "checkpoint_every_steps": 1000},
}
FREQUENT_SNAPSHOTS: dict[str, Any] = {
    "snapshot": {"every_seconds": 0.5},
    "train": {"batch_size": 4},
}
"""Sessions saved mid-episode: the rerun continues them under the next attempt."""


def job(
    tmp_path: Path, *, journal: bool, snapshots: dict[str, Any] = NO_SNAPSHOTS
) -> tuple[Path, Path]:
    log = tmp_path / "engine.jsonl"
    config = write_config(
        tmp_path,
        environment="tests.support.effect_log_env:EffectLogEnvironment",
        tasks=TASKS,
        group_size=1,
        concurrency=CONCURRENCY,
        policy={
            "latency_ms": 60,
            "error_rate": 0,
            "capture_tokens": "required",
            "call_log": str(log),
            "sampling": {"logprobs": True, "temperature": 1.0, "seed": "turn"},
        },
        journal={"enabled": journal},
        **snapshots,
    )
    return config, log


def kill_mid_run(start: Start, config: Path, log: Path, *, snapshots: int = 0) -> int:
    """Start the job, SIGKILL it once the engine has answered a third of the calls the job
    makes (about 4 a row) and ``snapshots`` snapshots were published (the first is taken
    before any row: a later one holds episodes in flight); the engine log's size at the
    kill."""
    run = start(config)
    seen: set[str] = set()  # retention prunes: count every snapshot ever seen published

    def ready() -> bool:
        seen.update(published(config.parent / "run"))
        return len(episode_calls(lines(log))) >= TASKS * 4 // 3 and len(seen) >= snapshots

    run.wait_until(ready, f"a third of the policy calls and {snapshots} snapshots")
    crash(run)
    return log.stat().st_size


def episode_calls(found: list[Any]) -> list[Any]:
    """The lines of episodes' calls: the start checks' probe (no seed) left out."""
    return [line for line in found if "seed" in line["request"]]


def redone(log: Path, at_kill: int) -> tuple[list[int], list[Any]]:
    """The seeds (keys) the engine logged before the kill and again after it; the lines
    before the kill."""
    before = episode_calls(lines(log, at_kill))
    after = episode_calls([orjson.loads(raw) for raw in log.read_bytes()[at_kill:].splitlines()])
    seeds_after = Counter(line["request"]["seed"] for line in after)
    twice = [line["request"]["seed"] for line in before if seeds_after[line["request"]["seed"]]]
    return twice, before


@pytest.fixture
def effects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "effects.jsonl"
    monkeypatch.setenv(LOG_ENV, str(path))  # the run's servers inherit it
    return path


@pytest.mark.parametrize(
    "snapshots", [NO_SNAPSHOTS, FREQUENT_SNAPSHOTS], ids=["none", "every_0.5s"]
)
def test_a_killed_job_redoes_only_the_calls_in_flight_and_no_journaled_effect_twice(
    tmp_path: Path, start: Start, effects: Path, snapshots: dict[str, Any]
) -> None:
    config, log = job(tmp_path, journal=True, snapshots=snapshots)
    # With snapshots every 0.5 s the rerun must resume from one that saved episodes in
    # flight (on a loaded machine the kill could otherwise come before the second one).
    at_kill = kill_mid_run(
        start, config, log, snapshots=3 if snapshots is FREQUENT_SNAPSHOTS else 0
    )
    effects_at_kill = lines(effects)  # the servers are dead: nothing more is written
    reruns = rerun_until_ok(start, config)
    if snapshots is FREQUENT_SNAPSHOTS:
        assert continued(reruns[0]) > 0, reruns[0].stderr[-2000:]

    twice, before = redone(log, at_kill)
    assert len(twice) <= CONCURRENCY, f"{len(twice)} policy calls done again: {twice}"
    last = {line["request"]["seed"] for line in before[-CONCURRENCY:]}
    assert set(twice) <= last, "a call finished well before the kill was done again"

    # Every trained turn carries what the engine sampled for it (before or after the kill).
    logged = {line["id"]: line for line in lines(log)}
    pre_kill = {line["id"] for line in before}
    rollouts = [
        orjson.loads(raw)
        for raw in (tmp_path / "run" / "train_data.jsonl").read_bytes().splitlines()
    ]
    kept = 0
    for rollout in rollouts:
        for turn in rollout["turns"]:
            (choice,) = logged[turn["completion_id"]]["choices"]
            assert turn["completion_token_ids"] == choice["token_ids"]
            assert turn["completion_logprobs"] == as_float32(choice["logprobs"])
            kept += turn["completion_id"] in pre_kill
    assert kept > 0, "no turn sampled before the kill reached training"

    # Each effect reached the outside world, and a journaled one only once. A tool call in
    # flight at the kill (its effect written, its journal record not yet durable) is in
    # doubt: it runs again after the restore, as issue 36's effect intents will prevent. So,
    # as for policy calls: at most one repeated effect per call in flight (CONCURRENCY),
    # each among the last effects before the kill, and never a third time.
    loaded = load_config(config)
    tasks = load_tasks_for(loaded)
    env = EffectLogEnvironment()
    expected = Counter((t.task_id, e) for t in tasks for e in env.expected_side_effects(t))
    seen = Counter((line["task"], line["effect"]) for line in lines(effects))
    assert set(seen) == set(expected), set(seen) ^ set(expected)
    assert set(expected.values()) == {1}
    repeated = {k for k, n in seen.items() if n > 1}
    assert all(seen[k] == 2 for k in repeated), {k: seen[k] for k in repeated}
    assert len(repeated) <= CONCURRENCY, f"{len(repeated)} effects made twice: {repeated}"
    in_doubt = {(line["task"], line["effect"]) for line in effects_at_kill[-CONCURRENCY:]}
    assert repeated <= in_doubt, "an effect made well before the kill was made again"

    found = invariants.check_workdir(
        loaded.workdir,
        tasks,
        loaded.group_size,
        resumed_since=reruns[-1].started_at,
        full_reward="all",
        final_states=loaded.final_states_log,
    )
    assert found == [], invariants.report(found)


def test_without_the_journal_the_same_kill_redoes_the_calls_and_effects(
    tmp_path: Path, start: Start, effects: Path
) -> None:
    """The baseline: the counts above have teeth."""
    config, log = job(tmp_path, journal=False)
    at_kill = kill_mid_run(start, config, log)
    rerun_until_ok(start, config)
    twice, before = redone(log, at_kill)
    assert len(twice) > CONCURRENCY and len(twice) >= len(before) // 2
    seen = Counter((line["task"], line["effect"]) for line in lines(effects))
    assert max(seen.values()) > 1
