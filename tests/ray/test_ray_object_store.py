"""Snapshots in an object store on the Ray runtime: ``snapshot.store: s3://…``, the driver
SIGKILLed and rerun to the end.

The replicas' servers run under actors on the test's two-node cluster, whose workers were
started before the test set the AWS variables: what reaches them is what the runtime
forwards (``ray.forward_env``). The S3-compatible server is moto's, on loopback, started by
the test (tests/chaos/test_object_store.py has the embedded run and the tampering).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollpoint.app.config import load_config
from rollpoint.job.tasks import load_tasks_for
from rollpoint.testing import invariants
from tests.chaos.test_object_store import published, runs, s3, write_config
from tests.ray.conftest import RayCluster
from tests.support.run_process import RunProcess

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]

__all__ = ["runs", "s3"]  # the fixtures, used by name

_RESUMED_FROM = re.compile(r"resumed\s+from\s+snapshot\s+(\S+)")


def test_a_ray_run_on_an_object_store_killed_and_rerun_trains_every_row_once(
    tmp_path: Path, s3: Any, runs: list[RunProcess], ray_cluster: RayCluster
) -> None:
    config = write_config(tmp_path)
    raw = yaml.safe_load(config.read_text())
    raw |= {"runtime": "ray", "ray": {"address": ray_cluster.address, "num_cpus_per_replica": 1}}
    config.write_text(yaml.safe_dump(raw))
    workdir = tmp_path / "run"

    runs.append(RunProcess(config))
    run = runs[-1]
    run.wait_until(
        lambda: any((workdir / "checkpoints").glob("step-*.json")),
        "a train checkpoint",
        timeout_s=120,
    )
    after_checkpoint = set(published(s3))
    run.wait_until(
        lambda: bool(set(published(s3)) - after_checkpoint),
        "a snapshot in the object store after the first train checkpoint",
        timeout_s=120,
        poll_s=0.25,
    )
    run.kill()
    # Nothing of the store is local: every participant on the cluster wrote objects.
    assert not (workdir / invariants.SNAPSHOT_STORE_DIR).exists()
    newest = published(s3)[-1]

    runs.append(RunProcess(config))
    rerun = runs[-1].finish(timeout_s=240)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Traceback" not in rerun.stderr
    match = _RESUMED_FROM.search(rerun.stderr)
    assert match, rerun.stderr[-3000:]
    assert match.group(1) >= newest  # the newest at the kill, or one published just after
    loaded = load_config(config)
    tasks = load_tasks_for(loaded.job_settings())
    rollouts, unreadable = invariants.read_train_data(workdir)
    found = [
        *unreadable,
        *invariants.check_exactly_once(rollouts, invariants.expected_rows(tasks, 2)),
        *invariants.check_side_effects_once(
            rollouts, invariants.created_titles(tasks), full_reward="all"
        ),
    ]
    assert found == [], invariants.report(found)
