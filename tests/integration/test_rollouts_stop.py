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
