"""The built-in loop (``rollpoint run``'s) on the façade: ``rollpoint.loop.run_builtin``.

A real job on the embedded runtime: the loop trains every row once through the façade's
batches, and the progress it is shown (``Rollouts.progress``) counts the run's rows from
the start and ends on the figures the run's summary reports.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from rollpoint import Rollouts, RunProgress
from rollpoint.app.config import RunConfig
from rollpoint.loop import run_builtin
from tests.support.small_job import small_job

pytestmark = pytest.mark.integration


def job(tmp_path: Path) -> RunConfig:
    return small_job(tmp_path, latency_ms=50, step_seconds=0.05)


async def test_the_built_in_loop_trains_every_row_once_and_shows_the_runs_progress(
    tmp_path: Path,
) -> None:
    config = job(tmp_path)
    seen: list[RunProgress] = []

    async def watch(run: Rollouts) -> None:
        try:
            while True:
                seen.append(run.progress())
                await asyncio.sleep(0.02)
        finally:
            seen.append(run.progress())  # the run's end, as a display draws it last

    summary = await run_builtin(config, step_seconds=config.train.step_seconds, watch=watch)

    assert summary.episodes == 12 and summary.train_steps == 3
    trained = [
        orjson.loads(x) for x in (config.workdir / "train_data.jsonl").read_bytes().splitlines()
    ]
    assert len({(r["group_id"], r["row"]) for r in trained}) == len(trained) == 12
    assert seen and all(p.episodes_total == 12 for p in seen)
    assert seen[0].episodes_finished < 12, "the display started after the run had ended"
    last = seen[-1]
    assert (last.episodes_finished, last.train_steps, last.in_flight) == (12, 3, 0)
    assert last.reward_mean == pytest.approx(summary.mean_reward)
    finished = [p.episodes_finished for p in seen]
    assert finished == sorted(finished)
