"""The small math job the façade's integration tests run: 6 tasks of 2 rows, one replica,
single-turn episodes, batches of 4 rows (3 steps), restart-only snapshots."""

from __future__ import annotations

from pathlib import Path

from rollpoint.app.config import RunConfig
from tests.support.job_config import job_config


def small_job(tmp_path: Path, *, latency_ms: int = 20, step_seconds: float = 0.0) -> RunConfig:
    """The job's config, its workdir (``tmp_path/run``) made."""
    return job_config(
        tmp_path,
        environment="math",
        tasks=6,
        max_turns=1,
        replicas=1,
        concurrency=4,
        policy={"latency_ms": latency_ms, "error_rate": 0},
        train={"batch_size": 4, "step_seconds": step_seconds},
        snapshot={"allow_restart_only": True},
    )
