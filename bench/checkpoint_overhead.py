"""Rollout throughput with snapshots every few seconds against snapshots off: the overhead
of checkpointing, as a ratio measured in one run.

The same job (real server processes, the real trainer, a policy with realistic latency) runs
four times, off, on, on, off: with ``snapshot.every_seconds`` set and with snapshots off
(and no train-checkpoint snapshots either, so only the periodic ones are measured).

On a shared machine two runs' throughputs swing by ±20 % from load alone, more than the
3 % target (one on/off pair measured 2.0 % and, an hour later, 10.6 %). So the runs are
ordered ABBA, the two "off" runs' spread is reported as the noise floor, and the item also
reports the share of the "on" runs that dispatch was paused (the snapshots' pauses summed
over their wall time) and the pause p50: a bound on what the snapshots can cost that load
does not blur as much.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

from bench.latency import percentile
from bench.report import BenchResult
from rollpoint.app.config import parse_config
from rollpoint.job.run import drive_quietly, run_job
from rollpoint.loop import SimulatedTrainer
from rollpoint.runtime.contract import Runtime
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.trainer import RunSummary, Trainer


async def _one(
    workdir: Path, every_s: float | None, tasks: int, latency_ms: float
) -> tuple[RunSummary, float, list[float]]:
    config = parse_config(
        {
            "workdir": str(workdir),
            "environment": "workplace",
            "tasks": tasks,
            "group_size": 4,
            "replicas": 2,
            "concurrency": 64,
            "policy": {"latency_ms": latency_ms, "error_rate": 0.0},
            "train": {"batch_size": 64, "checkpoint_every_steps": None},
            "snapshot": {"every_seconds": every_s},
        }
    )
    config.workdir.mkdir(parents=True, exist_ok=True)
    timing: dict[str, Any] = {}

    async def drive(trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics) -> RunSummary:
        t0 = time.monotonic()
        summary = await drive_quietly(trainer, runtime, metrics)
        timing["s"] = time.monotonic() - t0
        history = trainer.coordinator.history if trainer.coordinator else []
        timing["pauses"] = [r.pause_s for r in history if r.published]
        return summary

    summary = await run_job(
        config.job_settings(),
        fresh=False,
        hooks=SimulatedTrainer(config.train.step_seconds),
        say=lambda _: None,
        drive=drive,
    )
    return summary, float(timing["s"]), list(timing["pauses"])


ABBA = ("off", "on", "on", "off")


async def run(
    every_s: float = 5.0,
    tasks: int = 256,
    latency_ms: float = 100.0,
    order: tuple[str, ...] = ABBA,
) -> BenchResult:
    """Runs in ``order`` (default off, on, on, off: a load that drifts during the item
    weighs on both sides alike). The ratio is the mean "on" rate over the mean "off" rate;
    with two "off" runs, their spread is printed beside it as the noise it has to beat."""
    rates: dict[str, list[float]] = {"off": [], "on": []}
    turns: dict[str, list[float]] = {"off": [], "on": []}
    pauses: list[float] = []
    paused_s = on_wall_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for index, side in enumerate(order):
            every = every_s if side == "on" else None
            summary, wall_s, run_pauses = await _one(
                Path(tmp) / f"{side}{index}", every, tasks, latency_ms
            )
            rates[side].append(summary.episodes / wall_s)
            turns[side].append(summary.turns / wall_s)
            if side == "on":
                pauses += run_pauses
                paused_s += sum(run_pauses)
                on_wall_s += wall_s
    off_rate, on_rate = mean(rates["off"]), mean(rates["on"])
    noise: dict[str, float | int | str] = {}
    if len(rates["off"]) > 1:  # one "off" run has no spread to show
        noise["off_runs_spread_percent"] = (max(rates["off"]) - min(rates["off"])) / off_rate * 100
    return BenchResult(
        key="checkpoint_overhead",
        title=f"rollout throughput with snapshots every {every_s:g} s vs off",
        figures={
            "off_episodes_per_s": off_rate,
            "on_episodes_per_s": on_rate,
            "off_runs_episodes_per_s": " / ".join(f"{r:.1f}" for r in rates["off"]),
            "on_runs_episodes_per_s": " / ".join(f"{r:.1f}" for r in rates["on"]),
            **noise,
            "off_turns_per_s": mean(turns["off"]),
            "on_turns_per_s": mean(turns["on"]),
            "snapshots_taken": len(pauses),
            "pause_p50_ms": percentile(pauses, 50) * 1e3 if pauses else 0.0,
            "paused_percent_of_on_run": paused_s / on_wall_s * 100,
            "throughput_ratio_on_over_off": on_rate / off_rate,
            "overhead_percent": (1 - on_rate / off_rate) * 100,
        },
        params={
            "tasks": tasks,
            "group_size": 4,
            "replicas": 2,
            "policy_latency_ms": latency_ms,
            "runs": ", ".join(order) + "; rates averaged per side",
        },
    )
