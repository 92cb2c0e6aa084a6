"""Preemption on the Ray runtime: SIGTERM to the driver (``rollpoint run``) mid-job.

The replicas' servers run under Ray actors on the cluster's nodes; the driver takes the
final snapshot through them, stops them, and exits 143. The policy is the test's counting
one (the source of truth for policy calls), so the rerun's re-done calls are counted.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from rollpoint.store.snapshot_store import SnapshotStore
from tests.integration.test_preemption import GROUP, TASKS, _rerun, _rows
from tests.ray.conftest import RayCluster
from tests.support.counting_policy import counting_policy
from tests.support.run_process import RunProcess

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

GRACE_S = 25.0


def test_sigterm_to_the_ray_driver_saves_a_final_snapshot_and_the_rerun_redoes_none(
    tmp_path: Path, ray_cluster: RayCluster
) -> None:
    with counting_policy(latency_ms=300) as (url, calls):
        config = tmp_path / "job.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "workdir": str(tmp_path / "run"),
                    "runtime": "ray",
                    "ray": {"address": ray_cluster.address, "num_cpus_per_replica": 1},
                    "environment": "workplace",
                    "tasks": TASKS,
                    "group_size": GROUP,
                    "replicas": 2,
                    "concurrency": 8,
                    "policy": {"base_url": url},
                    "train": {"batch_size": 4},
                    "snapshot": {"every_seconds": 2.0},
                    "preemption": {"grace_seconds": GRACE_S},
                }
            )
        )
        run = RunProcess(config)
        run.wait_until(
            lambda: len(_rows(tmp_path / "run")) >= 4 and calls.snapshot()[1] > 0,
            "a train step with calls in flight",
            timeout_s=180,
        )
        _, in_flight = calls.snapshot()
        signalled_at = time.time()
        os.kill(run.proc.pid, signal.SIGTERM)
        finished = run.finish(timeout_s=GRACE_S + 15)
        assert finished.returncode == 143, finished.stderr[-3000:]
        assert time.time() - signalled_at <= GRACE_S
        assert "Traceback" not in finished.stderr
        store = SnapshotStore(str(tmp_path / "run" / "snapshots"), clean_leftovers=False)
        latest = store.latest()
        assert latest is not None and latest.published_at is not None
        assert latest.published_at > signalled_at
        assert f"snapshot {latest.snapshot_id} holds the run" in finished.stderr
        again = _rerun(config)
        assert again.returncode == 0, again.stderr[-3000:]
        rows = _rows(tmp_path / "run")
        seen = Counter((r["group_id"], r["row"]) for r in rows)
        assert len(seen) == TASKS * GROUP and set(seen.values()) == {1}
        needed = sum(len(r["model_calls"]) for r in rows)  # type: ignore[arg-type]
        redone = calls.snapshot()[0] - needed
        assert 0 <= redone <= in_flight, f"{redone} calls re-done, {in_flight} were in flight"
