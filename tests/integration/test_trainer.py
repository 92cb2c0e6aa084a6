"""The trainer loop end to end on real servers: every row trained exactly once, failed
groups reported, and a stall watchdog that does not count snapshot pauses."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollpoint.envs.registry import get_environment
from rollpoint.loop import SimulatedTrainer
from rollpoint.protocol.errors import RunStalledError
from rollpoint.testing import LocalCluster
from rollpoint.trainer.settings import TrainerSettings
from rollpoint.trainer.state.ledger_record import RolloutState
from rollpoint.trainer.train_hooks import TrainSample
from rollpoint.trainer.trainer import Trainer
from tests.support.polling import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(replicas=2, latency_ms=2.0, error_rate=0.2) as c:
        try:
            yield c
        finally:
            for replica in c.replicas:
                replica.on_gate(lambda gate: gate.open())


def config(workdir: Path, *, batch_size: int = 6, concurrency: int = 8) -> TrainerSettings:
    # The library's own settings, no run config: as a trainer embedding it would build them.
    return TrainerSettings(
        workdir=workdir, group_size=4, concurrency=concurrency, max_turns=12, batch_size=batch_size
    )


def read_train_data(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_every_row_of_every_group_is_trained_exactly_once(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    tasks = cluster.tasks(8)
    trainer = Trainer(config(tmp_path), cluster.deployment(), tasks, hooks=SimulatedTrainer())
    summary = await asyncio.wait_for(trainer.run(), 30)

    rows = read_train_data(tmp_path / "train_data.jsonl")
    keys = Counter((r["group_id"], r["row"]) for r in rows)
    expected = {(f"{t.task_id}-g0", row) for t in tasks for row in range(4)}
    assert set(keys) == expected
    assert set(keys.values()) == {1}
    assert len({r["rollout_id"] for r in rows}) == 32
    # batch_size 6 rounds up to two groups of 4: four steps, each whole groups.
    assert summary.train_steps == 4
    steps: dict[object, set[object]] = defaultdict(set)
    for r in rows:
        steps[r["group_id"]].add(r["train_step"])
    assert all(len(s) == 1 for s in steps.values())
    for group_id in steps:
        advantages = [float(str(r["advantage"])) for r in rows if r["group_id"] == group_id]
        assert abs(math.fsum(advantages)) < 1e-6
    assert (summary.episodes, summary.failed_groups) == (32, {})
    assert summary.turns == sum(len(r["turns"]) for r in rows)  # type: ignore[arg-type]
    assert summary.mean_reward == pytest.approx(
        math.fsum(float(str(r["reward"])) for r in rows) / 32
    )
    # Rows went to both replicas, and both model servers learned every policy version.
    sealed = [trainer.ledger.current(gid, row) for gid, row in expected]
    assert {r.state for r in sealed} == {RolloutState.SEALED}
    assert {r.replica for r in sealed} == {"replica-0", "replica-1"}
    assert [replica.policy_version() for replica in cluster.replicas] == [4, 4]
    assert trainer.finished_queue.counts()["consumed_groups"] == 0  # every step was committed
    assert trainer.stats.groups_trained == 8


class LaggingTraining:
    """Train hooks whose steps wait until the test lets them go: training slower than
    rollouts, as with a large policy."""

    def __init__(self) -> None:
        self.go = asyncio.Event()

    async def train_step(self, step: int, batch: list[TrainSample]) -> dict[str, float]:
        await self.go.wait()
        return {"samples": float(len(batch))}


async def test_finished_rollouts_waiting_for_training_stay_bounded_while_training_lags(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    # Unbounded, the dispatcher ran every group while the first step trained: the finished
    # queue held the whole run (issue 33's soak: the trainer grew 41 KiB a trained row).
    tasks = cluster.tasks(40)
    settings = TrainerSettings(
        workdir=tmp_path,
        group_size=4,
        concurrency=8,
        max_turns=12,
        batch_size=8,
        max_ready_batches=2,
    )
    hooks = LaggingTraining()
    trainer = Trainer(settings, cluster.deployment(), tasks, hooks=hooks)
    run = asyncio.create_task(trainer.run())
    try:
        limit = 2 * settings.batch_size

        def feed_held_back() -> bool:
            d = trainer.dispatcher
            return d is not None and d.idle and trainer.finished_queue.ready_rollouts >= limit

        await eventually(feed_held_back, "the feed waiting on a full finished queue", within_s=60)
        # What was in flight when the feed stopped finishes: at most the feed's window of
        # groups (concurrency / group_size + 1) more than the limit.
        window = (math.ceil(settings.concurrency / settings.group_size) + 1) * 4
        assert trainer.finished_queue.ready_rollouts <= limit + window
        sealed = trainer.ledger.counts()[RolloutState.SEALED]
        assert sealed <= settings.batch_size + limit + window < len(tasks) * 4
    finally:
        hooks.go.set()
    summary = await asyncio.wait_for(run, 120)
    assert summary.episodes == len(tasks) * 4
    rows = read_train_data(tmp_path / "train_data.jsonl")
    assert Counter((r["group_id"], r["row"]) for r in rows) == {
        (f"{t.task_id}-g0", row): 1 for t in tasks for row in range(4)
    }


async def test_a_group_with_a_data_failure_is_reported_and_the_others_train(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    tasks = cluster.tasks(3)
    (bad,) = get_environment("math").make_tasks(1, 7)  # the workplace agents refuse it
    trainer = Trainer(
        config(tmp_path, batch_size=4),
        cluster.deployment(),
        [*tasks, bad],
        hooks=SimulatedTrainer(),
    )
    summary = await asyncio.wait_for(trainer.run(), 30)

    bad_group = f"{bad.task_id}-g0"
    assert list(summary.failed_groups) == [bad_group]
    assert "environment_mismatch" in summary.failed_groups[bad_group]
    rows = read_train_data(tmp_path / "train_data.jsonl")
    assert {r["group_id"] for r in rows} == {f"{t.task_id}-g0" for t in tasks}
    assert len(rows) == summary.episodes == 12
    assert trainer.stats.failed_groups == 1


async def test_the_stall_watchdog_names_in_flight_rows_and_ignores_paused_time(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    for replica in cluster.replicas:
        replica.on_gate(lambda gate: gate.close())  # nothing can finish: a stall
    trainer = Trainer(
        config(tmp_path),
        cluster.deployment(),
        cluster.tasks(2),
        hooks=SimulatedTrainer(),
        stall_timeout_s=0.6,
    )
    started = time.monotonic()
    run = asyncio.create_task(trainer.run())
    deadline = time.monotonic() + 5
    while trainer.stats.in_flight < 8:
        assert time.monotonic() < deadline, "rows were never dispatched"
        await asyncio.sleep(0.01)
    closed = time.monotonic()
    trainer.barrier.close()
    await asyncio.sleep(1.2)  # twice the stall timeout, all of it paused by a "snapshot"
    assert not run.done()
    reopened = time.monotonic()
    trainer.barrier.open()
    with pytest.raises(RunStalledError) as failure:
        await asyncio.wait_for(run, 10)
    # It stalled once the time *not* paused reached the timeout (a loaded machine may spend
    # much of it dispatching before the close), never counting the 1.2 s paused.
    unpaused = (closed - started) + (time.monotonic() - reopened)
    assert unpaused >= 0.6 - 0.05
    message = failure.value.message
    assert "8 rows in flight" in message
    assert all(r.key in message for r in trainer.ledger.in_flight())
