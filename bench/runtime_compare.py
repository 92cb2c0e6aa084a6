"""The same job on the embedded and on the Ray runtime, and a replica actor killed mid-run.

Three runs of one job (real servers, the real trainer, snapshots on): on the embedded
runtime, on the Ray runtime (a local Ray instance: ``ray.address`` unset), and on the Ray
runtime again with one replica's actor killed by ``ray.kill`` once rows are on it. The
figures are rollout throughput side by side (time from the trainer's start to its end;
start-up is reported apart), and for the kill: the time from ``ray.kill`` to the trainer
being told the replica is down (Ray's death report, no timeout involved), to the trainer
being told its new actor is up, and to the first row dispatched to that new actor. Those
moments are read off the trainer's roster and ledger, polled every millisecond.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import BenchResult
from rollpoint.app.config import RunConfig, parse_config
from rollpoint.job.run import drive_quietly, run_job
from rollpoint.loop import SimulatedTrainer
from rollpoint.runtime.contract import Runtime
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.trainer import RunSummary, Trainer

LOST = "replica-1"
_POLL_S = 0.001


def _config(workdir: Path, runtime: str, tasks: int, latency_ms: float) -> RunConfig:
    config = parse_config(
        {
            "workdir": str(workdir),
            "runtime": runtime,
            "environment": "workplace",
            "tasks": tasks,
            "group_size": 4,
            "replicas": 2,
            "concurrency": 32,
            "policy": {"latency_ms": latency_ms, "error_rate": 0.0},
            "train": {"batch_size": 32},
            "snapshot": {"every_seconds": 2.0},
        }
    )
    config.workdir.mkdir(parents=True, exist_ok=True)
    return config


async def _until(condition: Any, timeout_s: float = 120.0) -> float:
    """Poll ``condition`` until true; the monotonic time it was first seen true."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the run did not reach the expected moment")
        await asyncio.sleep(_POLL_S)
    return time.monotonic()


async def _throughput(config: RunConfig) -> dict[str, float]:
    timing: dict[str, float] = {"t0": time.monotonic()}

    async def drive(trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics) -> RunSummary:
        timing["up"] = time.monotonic()
        summary = await drive_quietly(trainer, runtime, metrics)
        timing["end"] = time.monotonic()
        return summary

    summary = await run_job(
        config.job_settings(),
        fresh=True,
        hooks=SimulatedTrainer(config.train.step_seconds),
        say=lambda _: None,
        drive=drive,
    )
    seconds = timing["end"] - timing["up"]
    return {
        "start_s": timing["up"] - timing["t0"],
        "seconds": seconds,
        "episodes_per_s": summary.episodes / seconds,
        "turns_per_s": summary.turns / seconds,
    }


async def _kill_one(config: RunConfig) -> dict[str, float]:
    import ray

    from rollpoint.runtime.ray_runtime import RayRuntime

    marks: dict[str, float] = {}

    async def drive(trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics) -> RunSummary:
        assert isinstance(runtime, RayRuntime)
        job = asyncio.create_task(drive_quietly(trainer, runtime, metrics))
        await _until(lambda: trainer.ledger.in_flight_count(LOST) > 0)
        await asyncio.sleep(1.0)  # well into the run: turns under way, a snapshot or so
        before = trainer.roster.endpoints(LOST)

        def replaced() -> bool:
            return trainer.roster.is_up(LOST) and trainer.roster.endpoints(LOST) != before

        marks["kill"] = time.monotonic()
        ray.kill(runtime.actor(LOST))
        marks["down"] = await _until(lambda: not trainer.roster.is_up(LOST) or replaced())
        marks["up"] = await _until(replaced)
        marks["row"] = await _until(lambda: trainer.ledger.in_flight_count(LOST) > 0)
        return await job

    await run_job(
        config.job_settings(),
        fresh=True,
        hooks=SimulatedTrainer(config.train.step_seconds),
        say=lambda _: None,
        drive=drive,
    )
    return {
        "detect_s": marks["down"] - marks["kill"],
        "actor_up_s": marks["up"] - marks["kill"],
        "first_row_s": marks["row"] - marks["kill"],
    }


async def run(tasks: int = 128, latency_ms: float = 50.0) -> BenchResult:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        embedded = await _throughput(_config(root / "embedded", "embedded", tasks, latency_ms))
        on_ray = await _throughput(_config(root / "ray", "ray", tasks, latency_ms))
        killed = await _kill_one(_config(root / "kill", "ray", tasks, latency_ms))
    return BenchResult(
        key="runtime_compare",
        title="the same job on the embedded and the Ray runtime; a replica actor killed",
        figures={
            "embedded_episodes_per_s": embedded["episodes_per_s"],
            "ray_episodes_per_s": on_ray["episodes_per_s"],
            "embedded_turns_per_s": embedded["turns_per_s"],
            "ray_turns_per_s": on_ray["turns_per_s"],
            "ray_over_embedded": on_ray["episodes_per_s"] / embedded["episodes_per_s"],
            "embedded_start_s": embedded["start_s"],
            "ray_start_s": on_ray["start_s"],
            "kill_to_replica_down_s": killed["detect_s"],
            "kill_to_new_actor_up_s": killed["actor_up_s"],
            "kill_to_first_row_on_new_actor_s": killed["first_row_s"],
        },
        params={
            "tasks": tasks,
            "group_size": 4,
            "replicas": 2,
            "concurrency": 32,
            "policy_latency_ms": latency_ms,
            "ray": "local instance, 1 CPU per replica",
        },
    )
