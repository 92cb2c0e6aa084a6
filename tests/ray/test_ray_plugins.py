"""An environment loaded by import path on the Ray runtime: every replica's servers load it.

The sandbox example (``examples/sandbox_env``, installed) named as
``sandbox_env:SandboxEnvironment``: each replica actor's resources server resolves the
reference in its own process, as the embedded runtime's do, and a whole job trains every
row once.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import sandbox_env  # installed by make (pip install -e examples/sandbox_env)

from rollpoint.app.config import parse_config
from rollpoint.http.client import HttpClient
from rollpoint.job.run import run_job
from rollpoint.job.tasks import load_tasks_for
from rollpoint.loop import SimulatedTrainer
from rollpoint.runtime.ray_runtime import RayRuntime
from rollpoint.testing import invariants
from tests.ray.conftest import RayCluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]


async def test_an_environment_by_import_path_runs_on_every_replica_actor(
    tmp_path: Path, ray_cluster: RayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDBOX_ROOT", str(tmp_path / "sandboxes"))
    config = parse_config(
        {
            "workdir": str(tmp_path / "run"),
            "runtime": "ray",
            "ray": {"address": ray_cluster.address, "num_cpus_per_replica": 1},
            "environment": "sandbox_env:SandboxEnvironment",
            "dataset": str(sandbox_env.TASKS),
            "group_size": 2,
            "replicas": 2,
            "concurrency": 6,
            "policy": {"latency_ms": 50, "error_rate": 0.0, "tool_turns": 3},
            "train": {"batch_size": 4},
            "snapshot": {"every_seconds": 0.3},
        }
    )
    config.workdir.mkdir(parents=True, exist_ok=True)
    async with (
        RayRuntime(
            config.runtime_settings(),
            control_token=secrets.token_urlsafe(16),
            snapshot_root=config.snapshot_root(),
        ) as rt,
        HttpClient(timeout_s=10) as http,
    ):
        assert rt.deployment is not None
        for replica in rt.deployment.replicas:
            tools = await http.get_json(f"{replica.resources_url}/tools")
            assert tools["environment"] == "sandbox"
            assert "fs_append" in {t["function"]["name"] for t in tools["tools"]}

    summary = await run_job(
        config.job_settings(),
        fresh=True,
        hooks=SimulatedTrainer(config.train.step_seconds),
        say=lambda _: None,
    )

    assert not summary.failed_groups
    rollouts, unreadable = invariants.read_train_data(config.workdir)
    expected = invariants.expected_rows(load_tasks_for(config.job_settings()), config.group_size)
    found = [*unreadable, *invariants.check_exactly_once(rollouts, expected)]
    assert found == [], invariants.report(found)
