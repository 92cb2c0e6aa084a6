"""A stop is a stop, on the façade: once its ``StopRequest`` is asked, ``batches()`` hands
out no batch, and the run ends with the one error that names the snapshot holding it."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import orjson
import pytest

from rollpoint import Rollouts, StopRequest
from rollpoint.protocol.errors import RunPreemptedError
from rollpoint.trainer.snapshot.cut import SaveReport
from tests.support.polling import eventually
from tests.support.small_job import small_job

pytestmark = pytest.mark.integration


async def test_batches_end_once_the_stop_is_asked(tmp_path: Path) -> None:
    config = small_job(tmp_path, latency_ms=5)
    task = asyncio.current_task()
    assert task is not None
    stop = StopRequest(cancel=task.cancel)
    handed: list[int] = []
    with pytest.raises(RunPreemptedError) as stopped:
        async with Rollouts(config, stop=stop) as run:
            async for batch in run.batches():
                handed.append(batch.step)
                batch.done()
                if batch.step == 1:
                    # The trainer hands step 2 out (queued for the loop) before the signal
                    # comes: the loop must not train it after the final snapshot.
                    await eventually(
                        lambda: run._batches.qsize() > 0, "step 2 handed out", within_s=30
                    )
                    stop.signal(signal.SIGTERM)
            await run.summary()
    assert handed == [1], "a batch was handed out after the stop"
    assert "holds the run" in stopped.value.message
    rows = (config.workdir / "train_data.jsonl").read_bytes().splitlines()
    assert {orjson.loads(r)["train_step"] for r in rows} <= {1}


async def test_no_save_is_taken_after_the_final_one_and_none_says_resume_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A periodic save that came after the stop's final one found the participants held by
    # the final cut: "resume ... refused" twice, and a snapshot attempt after the final.
    config = small_job(tmp_path, latency_ms=300)
    task = asyncio.current_task()
    assert task is not None
    stop = StopRequest(cancel=task.cancel)
    late: list[SaveReport] = []
    with pytest.raises(RunPreemptedError) as stopped:
        async with Rollouts(config, stop=stop) as run:
            coordinator = run._started().coordinator
            assert coordinator is not None
            async for batch in run.batches():
                batch.done()
                stop.signal(signal.SIGTERM)
                await eventually(lambda: coordinator.final_asked, "the final save asked")
                late.append(await run.snapshot())
            await run.summary()
    assert "holds the run" in stopped.value.message
    assert len(late) == 1 and late[0].not_taken and not late[0].published
    final = coordinator.history[-1]
    assert final.published and final.snapshot_id in stopped.value.message
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refused == []
