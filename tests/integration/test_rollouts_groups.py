"""Prompt groups handed to a run while it runs (``Rollouts(..., more_groups=True)``).

A real job on the embedded runtime (real server processes): groups added before and after
the first batch are each trained once and the run ends only after ``end_groups``; a run
stopped and opened again takes the same stream added again and adds only what its snapshot
lacks; bad input is one line and changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from rollpoint import RunConfig, SyncRollouts, TaskRow, parse_config
from rollpoint.envs import get_environment
from rollpoint.protocol.errors import BadRequestError, ConfigError, InvalidPhaseError

pytestmark = pytest.mark.integration

GROUP_SIZE = 2


def job(tmp_path: Path, tasks: int = 0) -> RunConfig:
    config = parse_config(
        {
            "workdir": str(tmp_path / "run"),
            "environment": "math",
            "tasks": tasks,
            "group_size": GROUP_SIZE,
            "max_turns": 1,
            "replicas": 1,
            "concurrency": 4,
            "policy": {"latency_ms": 20, "error_rate": 0},
            "train": {"batch_size": 4},
            "snapshot": {"allow_restart_only": True},
        }
    )
    config.workdir.mkdir(parents=True, exist_ok=True)
    return config


def stream(n: int) -> list[TaskRow]:
    """The trainer's own task stream: ids of its own, the environment's problems."""
    made = get_environment("math").make_tasks(n, 7)
    return [t.model_copy(update={"task_id": f"mine-{i:03d}"}) for i, t in enumerate(made)]


def trained_rows(config: RunConfig) -> list[tuple[str, int]]:
    lines = (config.workdir / "train_data.jsonl").read_bytes().splitlines()
    return [(r["group_id"], r["row"]) for r in map(orjson.loads, lines)]


def test_groups_added_while_running_are_each_trained_once_and_the_run_waits_for_the_end(
    tmp_path: Path,
) -> None:
    config = job(tmp_path)
    tasks = stream(6)
    steps = []
    with SyncRollouts(config, more_groups=True) as run:
        assert run.add_groups(tasks[:2]) == ["mine-000-g0", "mine-001-g0"]
        for batch in run.batches():
            steps.append(batch.step)
            if batch.step == 1:
                # Nothing is left in flight now: the run waits for more rather than end.
                assert run.add_groups(tasks[2:]) == [f"mine-{i:03d}-g0" for i in range(2, 6)]
            if batch.step == 3:
                run.end_groups()
            batch.done()
        summary = run.summary()
    assert steps == [1, 2, 3]
    rows = trained_rows(config)
    assert sorted(rows) == sorted((f"mine-{i:03d}-g0", r) for i in range(6) for r in range(2))
    assert summary.episodes == 12


def test_a_resumed_run_given_its_stream_again_adds_only_what_its_snapshot_lacks(
    tmp_path: Path,
) -> None:
    config = job(tmp_path)
    tasks = stream(6)
    with SyncRollouts(config, more_groups=True) as run:
        run.add_groups(tasks[:4])
        for batch in run.batches():
            if batch.step == 2:
                break  # step 1 checkpointed and snapshotted; stopped before step 2 is done
            batch.done()

    with SyncRollouts(config, more_groups=True) as run:
        assert run.resumed_step == 1
        added = run.add_groups(tasks)  # the whole stream again, from the trainer's start
        assert added == ["mine-004-g0", "mine-005-g0"]  # the first four are the snapshot's
        run.end_groups()
        for batch in run.batches():
            batch.done()
        run.summary()
    rows = trained_rows(config)
    assert sorted(rows) == sorted((f"mine-{i:03d}-g0", r) for i in range(6) for r in range(2))


def test_bad_groups_are_refused_in_one_line_and_change_nothing(tmp_path: Path) -> None:
    config = job(tmp_path, tasks=2)
    other = get_environment("workplace").make_tasks(1, 0)
    (task,) = stream(1)
    with SyncRollouts(config) as run:
        with pytest.raises(InvalidPhaseError, match="takes no more groups"):
            run.add_groups([task])
        for batch in run.batches():
            batch.done()
    with SyncRollouts(job(tmp_path / "open"), more_groups=True) as run:
        with pytest.raises(BadRequestError, match="is for another environment than 'math'"):
            run.add_groups([task, *other])
        with pytest.raises(BadRequestError, match="appear more than once"):
            run.add_groups([task, task])
        run.add_groups([task])
        changed = task.model_copy(update={"prompt": "something else"})
        with pytest.raises(BadRequestError, match="mine-000 was added with other contents"):
            run.add_groups([changed])
        run.end_groups()
        for batch in run.batches():
            batch.done()
        assert run.summary().episodes == GROUP_SIZE


def test_a_run_with_no_tasks_that_takes_none_is_refused_before_any_server_starts(
    tmp_path: Path,
) -> None:
    refused = pytest.raises(ConfigError, match=r"^tasks: 0 gives the run nothing to train")
    with refused, SyncRollouts(job(tmp_path)):
        pass
    assert not (tmp_path / "run" / "logs").exists()
