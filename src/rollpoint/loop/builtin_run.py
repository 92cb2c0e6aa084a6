"""The built-in run: what ``rollpoint run`` trains, on the façade's calls only.

Owns :func:`run_builtin`: open :class:`rollpoint.Rollouts` on the run's settings, pull each
batch, apply the simulated update (:class:`~rollpoint.loop.SimulatedTrainer`), say the batch
is done — the calls ``examples/own_trainer.py`` makes with its own update. Everything a
run needs besides (resume, snapshots, replicas lost and back, a signal's final snapshot)
is the façade's. The display is the caller's: ``watch`` is given the open run and cancelled
when the run ends (the CLI draws progress from :meth:`Rollouts.progress`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from rollpoint import (
    JobConfig,
    JobSettings,
    Rollouts,
    RunSummary,
    ServedDeployment,
    StopRequest,
)
from rollpoint.loop.simulated_trainer import SimulatedTrainer

log = logging.getLogger(__name__)

Watch = Callable[[Rollouts], Coroutine[Any, Any, None]]


async def run_builtin(
    config: JobSettings | JobConfig,
    *,
    step_seconds: float = 0.0,
    fresh: bool = False,
    deployment: ServedDeployment | None = None,
    stop: StopRequest | None = None,
    say: Callable[[str], None] = log.info,
    watch: Watch | None = None,
    retry_failed: bool = False,
) -> RunSummary:
    """Run the config's job to its end with the simulated update, each step taking
    ``step_seconds`` (``train.step_seconds``); the other arguments are the façade's
    (:class:`rollpoint.Rollouts`). A stop request's first signal ends it with
    :class:`~rollpoint.protocol.errors.RunPreemptedError` after the final snapshot."""
    update = SimulatedTrainer(step_seconds)
    async with Rollouts(
        config,
        deployment=deployment,
        fresh=fresh,
        stop=stop,
        say=say,
        retry_failed=retry_failed,
    ) as run:
        shown = None if watch is None else asyncio.create_task(watch(run))
        try:
            async for batch in run.batches():
                batch.done(await update.train_step(batch.step, batch.samples))
            return await run.summary()
        finally:
            if shown is not None:
                shown.cancel()
                # A display that failed must not hide how the run ended: its error is dropped.
                await asyncio.gather(shown, return_exceptions=True)
