"""The staleness bound, ``train.max_policy_lag``, on a real job (embedded runtime, real server
processes) whose training is slowed on purpose, so rollouts finish far faster than they are
trained and the policy (one version per train step) moves on under them.

Unbounded, samples are trained several versions behind (and ``train_data.jsonl`` records
each one's lag and its turns', as handed over); with the bound, no sample handed
to the trainer is beyond it (each turn's version read from the sample's own calls, against
the version live when the batch was handed out), new episodes were held for it, and every
task is still trained exactly once. With ``stale_samples: mark`` a sample beyond it is
handed over marked, and only such a sample.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint import RunConfig, SyncRollouts, TrainSample, parse_config

pytestmark = pytest.mark.integration

TASKS = 12
STEP_S = 0.25
"""The slowed train step: rollouts (one group at a time, 60 ms each) pile up behind it."""


def job(tmp_path: Path, **train: Any) -> RunConfig:
    config = parse_config(
        {
            "workdir": str(tmp_path / "run"),
            "environment": "math",
            "tasks": TASKS,
            "group_size": 2,
            "max_turns": 1,
            "replicas": 1,
            "concurrency": 2,
            "policy": {"latency_ms": 60, "error_rate": 0},
            "train": {"batch_size": 2, **train},
            "snapshot": {"allow_restart_only": True},
        }
    )
    config.workdir.mkdir(parents=True, exist_ok=True)
    return config


def oldest_turn(sample: TrainSample) -> int:
    """The oldest version that sampled any token of the sample, from its calls."""
    return min(
        min((s.policy_version for s in c.segments), default=c.policy_version)
        if c.segments
        else c.policy_version
        for c in sample.model_calls
    )


def slowed_run(config: RunConfig) -> tuple[list[tuple[int, TrainSample]], Any]:
    """Each sample with the version live when its batch was handed out; the last progress."""
    seen: list[tuple[int, TrainSample]] = []
    progress = None
    with SyncRollouts(config) as run:
        for batch in run.batches():
            progress = run.progress()  # counts up to this batch, read while the run runs
            seen += [(progress.policy_version, s) for s in batch.samples]
            time.sleep(STEP_S)  # the slow update
            batch.done()
        run.summary()
    return seen, progress


def written_lags(config: RunConfig) -> dict[str, tuple[int, list[int]]]:
    """Each trained rollout's lag and its turns' lags, as ``train_data.jsonl`` records them."""
    lines = (config.workdir / "train_data.jsonl").read_bytes().splitlines()
    return {
        row["rollout_id"]: (row["policy_lag"], [t["policy_lag"] for t in row["turns"]])
        for row in map(orjson.loads, lines)
    }


def trained_once(seen: list[tuple[int, TrainSample]]) -> None:
    tasks = sorted(s.task_id for _, s in seen)
    assert len(seen) == 2 * TASKS
    assert sorted(set(tasks)) == tasks[::2] and len(set(tasks)) == TASKS  # each task, 2 rows


def test_unbounded_the_slow_trainer_trains_samples_several_versions_behind(
    tmp_path: Path,
) -> None:
    config = job(tmp_path)
    seen, _ = slowed_run(config)
    trained_once(seen)
    assert max(live - oldest_turn(s) for live, s in seen) > 1  # what the bound must stop
    # train_data.jsonl records each sample's lag and its turns' as they were handed over.
    assert written_lags(config) == {
        s.rollout_id: (live - oldest_turn(s), [t.policy_lag for t in s.trajectory])
        for live, s in seen
    }


def test_no_sample_is_trained_beyond_the_bound_and_each_task_is_trained_once(
    tmp_path: Path,
) -> None:
    seen, progress = slowed_run(job(tmp_path, max_policy_lag=1))
    trained_once(seen)
    for live, sample in seen:
        lag = live - oldest_turn(sample)
        assert lag <= 1, (sample.group_id, lag)
        assert sample.policy_lag == lag and not sample.stale
        assert [t.policy_lag for t in sample.trajectory] == [
            live - c.policy_version for c in sample.model_calls
        ]
    assert progress.lag_holds > 0  # new episodes waited for the bound


def test_marked_samples_are_exactly_those_beyond_the_bound(tmp_path: Path) -> None:
    seen, progress = slowed_run(job(tmp_path, max_policy_lag=0, stale_samples="mark"))
    trained_once(seen)
    stale = [s for live, s in seen if live - oldest_turn(s) > 0]
    assert [s.stale for _, s in seen] == [live - oldest_turn(s) > 0 for live, s in seen]
    assert progress.stale_marked == len(stale) and progress.stale_resent == 0
