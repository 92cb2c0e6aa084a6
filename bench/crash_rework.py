"""Work re-done after a crash: turn-level recovery against ``recovery: restart``.

The same job (seeded, deterministic policy, no policy mistakes) runs three ways in one go:
without a crash (the baseline), and killed at the same moment then resumed, once with
``recovery: turn`` and once with ``recovery: restart``. The kill is real: every server
process of the run gets SIGKILL and the trainer stops where it is; the rerun restores from
the newest published snapshot. Policy calls are counted by the model servers
(``calls_total``) of each run; re-done work is what the crashed job needed beyond the
baseline, in policy calls and in seconds of rollout time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import BenchResult
from rollpoint.config import RunConfig, parse_config
from rollpoint.http.client import HttpClient
from rollpoint.job import drive_quietly, run_job
from rollpoint.runtime.contract import Runtime
from rollpoint.runtime.embedded import EmbeddedRuntime
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.control_plane import snapshot_root
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.trainer_loop import RunSummary, Trainer


class Killed(Exception):
    """The bench's crash: raised out of the first run after its servers were SIGKILLed."""


@dataclass
class Leg:
    calls: int = 0
    seconds: float = 0.0


# The model servers' /stats is a data route: the bench hands run_job the token it reads with.
DATA_TOKEN = secrets.token_urlsafe(16)


async def _calls(runtime: Runtime) -> int:
    assert runtime.deployment is not None
    async with HttpClient(token=DATA_TOKEN, timeout_s=10) as http:
        stats = await asyncio.gather(
            *(
                http.get_json(f"{r.model_url}/rollpoint/v1/stats")
                for r in runtime.deployment.replicas
            )
        )
    return sum(int(s["calls_total"]) for s in stats)


def _config(workdir: Path, recovery: str, tasks: int) -> RunConfig:
    config = parse_config(
        {
            "workdir": str(workdir),
            "environment": "workplace",
            "tasks": tasks,
            "group_size": 4,
            "max_turns": 8,
            "replicas": 2,
            "concurrency": 32,
            "policy": {"latency_ms": 40, "error_rate": 0.0},
            "train": {"batch_size": 16},
            "snapshot": {"every_seconds": 0.5},
            "recovery": recovery,
        }
    )
    config.workdir.mkdir(parents=True, exist_ok=True)
    return config


def _say(_: str) -> None:
    pass


async def _full_run(config: RunConfig, leg: Leg) -> RunSummary:
    async def drive(trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics) -> RunSummary:
        t0 = time.monotonic()
        summary = await drive_quietly(trainer, runtime, metrics)
        leg.seconds += time.monotonic() - t0
        leg.calls += await _calls(runtime)
        return summary

    return await run_job(config, fresh=False, say=_say, drive=drive, data_token=DATA_TOKEN)


async def _killed_run(config: RunConfig, leg: Leg, kill_after_s: float) -> None:
    store_root = snapshot_root(config)

    async def drive(trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics) -> Any:
        assert isinstance(runtime, EmbeddedRuntime), "the kill needs local server processes"
        t0 = time.monotonic()
        job = asyncio.create_task(drive_quietly(trainer, runtime, metrics))
        # Kill at the same moment of the job in both modes, as soon as a snapshot is
        # published: what is lost is then what the snapshot itself could not save.
        await asyncio.sleep(kill_after_s)
        store = SnapshotStore(store_root, clean_leftovers=False)

        def published() -> set[str]:
            return {s.snapshot_id for s in store.list_snapshots()}

        # By id, not by count: once retention keeps its 3, a publication prunes one and
        # the count stays put (the kill then came after the job had ended).
        seen = published()
        while published() <= seen and not job.done():  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        if job.done():
            raise RuntimeError(f"the job ended before a snapshot published after {kill_after_s}s")
        leg.calls += await _calls(runtime)
        for child in runtime.group.children:
            if child.alive:
                os.kill(child.process.pid, signal.SIGKILL)
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        leg.seconds += time.monotonic() - t0
        raise Killed

    with contextlib.suppress(Killed):
        await run_job(config, fresh=False, say=_say, drive=drive, data_token=DATA_TOKEN)


KILL_AT_SHARE = 0.4
"""The kill comes this far into the crash-free baseline's run time: a fixed moment would
land after the end once the job gets faster (it did)."""


async def run(tasks: int = 32, kill_after_s: float | None = None) -> BenchResult:
    figures: dict[str, float | int | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Leg()
        await _full_run(_config(Path(tmp) / "baseline", "turn", tasks), base)
        figures["baseline_policy_calls"] = base.calls
        figures["baseline_seconds"] = base.seconds
        if kill_after_s is None:
            kill_after_s = round(KILL_AT_SHARE * base.seconds, 2)
        figures["kill_after_s"] = kill_after_s
        for mode in ("turn", "restart"):
            leg = Leg()
            config = _config(Path(tmp) / mode, mode, tasks)
            await _killed_run(config, leg, kill_after_s)
            figures[f"{mode}_calls_before_kill"] = leg.calls
            await _full_run(config, leg)
            figures[f"{mode}_policy_calls_redone"] = leg.calls - base.calls
            figures[f"{mode}_seconds_redone"] = leg.seconds - base.seconds
        turn, restart = figures["turn_policy_calls_redone"], figures["restart_policy_calls_redone"]
        assert isinstance(turn, int) and isinstance(restart, int)
        figures["redone_calls_ratio_turn_over_restart"] = (
            turn / restart if restart else float("nan")
        )
    return BenchResult(
        key="crash_rework",
        title="work re-done after a crash: turn-level recovery vs recovery: restart",
        figures=figures,
        params={
            "tasks": tasks,
            "group_size": 4,
            "replicas": 2,
            "policy_latency_ms": 40,
            "snapshot_every_s": 0.5,
            "kill": f"SIGKILL of every server at the first snapshot published after {kill_after_s}s",
        },
    )
