"""What a real trainer records in ``run_events.jsonl``: train steps, a replica lost and back,
and samples of the episodes in flight with the model servers' call counters."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollpoint.app.config import RunConfig
from rollpoint.trainer.run_events import (
    EVENTS_FILE,
    InFlight,
    ReplicaDown,
    ReplicaUp,
    RunEvents,
    TrainStep,
    read_events,
)
from tests.support.embedded_job import embedded_job
from tests.support.job_config import job_config
from tests.support.polling import eventually

pytestmark = pytest.mark.process

LOST = "replica-1"


def job(tmp_path: Path) -> RunConfig:
    return job_config(
        tmp_path,
        tasks=16,
        concurrency=6,
        policy={"latency_ms": 40, "error_rate": 0.0},
        train={"batch_size": 4, "checkpoint_every_steps": 1},
        snapshot={"every_seconds": 0.3, "deadline_seconds": 5, "retry_after_seconds": 0},
    )


@pytest.mark.timeout(300)
async def test_a_run_records_train_steps_replica_loss_and_in_flight_samples(
    tmp_path: Path,
) -> None:
    config = job(tmp_path)
    path = config.workdir / EVENTS_FILE
    async with embedded_job(config) as h:
        h.trainer.events = RunEvents(path)
        run = asyncio.create_task(h.trainer.run())
        await eventually(
            lambda: (
                h.trainer.ledger.in_flight_count(LOST) > 0 and len(h.store.list_snapshots()) > 0
            ),
            "rows in flight on the replica to lose, and a snapshot published",
            within_s=30,
        )
        for child in [c for c in h.runtime.group.children if c.spec.name.endswith(LOST)]:
            child.process.kill()
            await child.process.wait()
        await h.trainer.replica_down(LOST)
        endpoints = await h.runtime.restart_replica(LOST)
        await h.trainer.replica_up(endpoints)
        summary = await asyncio.wait_for(run, 120)

    log = read_events(path)
    assert (log.skipped, log.newer) == (0, 0)
    steps = [e.step for e in log.events if isinstance(e, TrainStep)]
    assert steps == list(range(1, summary.train_steps + 1))
    (down,) = [e for e in log.events if isinstance(e, ReplicaDown)]
    (up,) = [e for e in log.events if isinstance(e, ReplicaUp)]
    assert down.replica == up.replica == LOST
    assert down.ts <= up.ts
    assert up.restored <= down.held
    samples = [e for e in log.events if isinstance(e, InFlight)]
    assert samples, "no in-flight sample"
    # While it was down, samples leave the lost replica out; otherwise both are there.
    assert {"replica-0", LOST} <= {name for s in samples for name in s.episodes}
    assert any(sum(s.episodes.values()) > 0 for s in samples)
    # The model servers' counters only grow within one process's life.
    calls = [s.policy_calls["replica-0"] for s in samples if "replica-0" in s.policy_calls]
    assert calls and calls == sorted(calls) and calls[-1] > 0
