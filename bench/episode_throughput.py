"""Episodes per second of the workplace demo at zero policy latency, end to end.

Real server processes (embedded runtime), the real trainer loop; only the policy's
simulated thinking time is set to zero, so this measures rollpoint's own cost per episode.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.report import BenchResult
from rollpoint.app.config import parse_config
from rollpoint.envs import get_environment
from rollpoint.loop import SimulatedTrainer
from rollpoint.runtime.embedded import EmbeddedRuntime
from rollpoint.trainer.trainer import Trainer
from rollpoint.tuning import install as install_tuning


async def run(tasks: int = 64, replicas: int = 2, concurrency: int = 64) -> BenchResult:
    install_tuning()  # the trainer runs here: as run_job, its entry point, would
    with tempfile.TemporaryDirectory() as tmp:
        config = parse_config(
            {
                "workdir": str(Path(tmp) / "run"),
                "environment": "workplace",
                "tasks": tasks,
                "group_size": 4,
                "replicas": replicas,
                "concurrency": concurrency,
                "policy": {"latency_ms": 0, "error_rate": 0.05},
                "train": {"batch_size": 16},
            }
        )
        config.workdir.mkdir(parents=True)
        rows = get_environment("workplace").make_tasks(tasks, config.seed)
        async with EmbeddedRuntime(config.runtime_settings()) as runtime:
            assert runtime.deployment is not None
            trainer = Trainer(
                config.trainer_settings(),
                runtime.deployment,
                rows,
                hooks=SimulatedTrainer(config.train.step_seconds),
            )
            t0 = time.perf_counter()
            summary = await trainer.run()
            elapsed = time.perf_counter() - t0
    return BenchResult(
        key="episode_throughput",
        title="workplace demo end to end at zero policy latency",
        figures={
            "episodes": summary.episodes,
            "turns": summary.turns,
            "seconds": elapsed,
            "episodes_per_s": summary.episodes / elapsed,
            "turns_per_s": summary.turns / elapsed,
            "mean_reward": summary.mean_reward,
        },
        params={"tasks": tasks, "group_size": 4, "replicas": replicas, "concurrency": concurrency},
    )
