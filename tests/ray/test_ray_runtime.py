"""The Ray runtime on a real two-node cluster (``conftest.ray_cluster``): replicas as actors.

Each replica's servers run under its actor on the node Ray placed it (one CPU a node, one
CPU a replica: one replica a node), serve the driver at the URLs the actor reported, and
stop with the runtime. A replica whose server process dies is replaced by a new actor. A
whole job runs with ``runtime: ray``; one replica actor is killed with ``ray.kill``
mid-job: Ray's report of the death marks the replica down, a new actor takes its place and
gets rows, the other replica is never touched, and the run's workdir holds the invariants
of docs/design.md#invariants.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from rollpoint.app.config import RunConfig
from rollpoint.http.client import HttpClient
from rollpoint.job.run import drive_quietly, run_job
from rollpoint.job.tasks import load_tasks_for
from rollpoint.loop import SimulatedTrainer
from rollpoint.protocol.deployment import ReplicaEndpoints
from rollpoint.runtime.contract import Runtime
from rollpoint.runtime.ray_runtime import RayRuntime
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.testing import invariants
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.trainer import RunSummary, Trainer
from tests.ray.conftest import RayCluster
from tests.support.job_config import job_config
from tests.support.polling import eventually
from tests.support.processes import wait_gone

pytestmark = [pytest.mark.ray, pytest.mark.timeout(90)]

LOST, KEPT = "replica-1", "replica-0"
WAIT_S = 30.0
"""How long a cluster event may take on a loaded 2-core machine."""


def ray_job(tmp_path: Path, cluster: RayCluster, **overrides: Any) -> RunConfig:
    return job_config(
        tmp_path,
        **{
            "runtime": "ray",
            "ray": {"address": cluster.address, "num_cpus_per_replica": 1},
            "tasks": 16,
            "concurrency": 6,
            "policy": {"latency_ms": 100, "error_rate": 0.0},
            "snapshot": {"every_seconds": 0.3},
            **overrides,
        },
    )


def published(workdir: Path) -> int:
    snapshots = workdir / invariants.SNAPSHOT_STORE_DIR / "snapshots"
    return len(list(snapshots.glob("*/manifest.json")))


@pytest.mark.timeout(180)  # a hang guard: two tests' work in one (50 s at a load of 30)
async def test_each_replica_is_an_actor_on_its_own_node_and_one_whose_server_dies_is_replaced(
    tmp_path: Path, ray_cluster: RayCluster
) -> None:
    # One runtime for both: each replica an actor on its own node serving the driver, all
    # its servers gone with the runtime; a replica whose server dies gets a new actor, and
    # the others are untouched.
    config = ray_job(tmp_path, ray_cluster)
    root = config.snapshot_root()
    events: list[tuple[str, object]] = []

    async def on_down(name: str) -> None:
        events.append(("down", name))

    async def on_up(endpoints: ReplicaEndpoints) -> None:
        events.append(("up", endpoints))

    async with (
        RayRuntime(
            config.runtime_settings(), control_token=secrets.token_urlsafe(16), snapshot_root=root
        ) as rt,
        HttpClient(timeout_s=10) as http,
    ):
        assert rt.deployment is not None
        names = [r.name for r in rt.deployment.replicas]
        nodes = {n: await rt.actor(n).node_id.remote() for n in names}
        pids = [p for n in names for p in (await rt.actor(n).pids.remote()).values()]
        for replica in rt.deployment.replicas:
            tools = await http.get_json(f"{replica.resources_url}/tools")
            models = await http.get_json(f"{replica.model_url}/v1/models")
            assert tools["environment"] == "workplace"
            assert models["data"][0]["id"] == config.policy.model
        before = {r.name: r for r in rt.deployment.replicas}
        kept_actor = rt.actor(KEPT)
        servers = await rt.actor(LOST).pids.remote()
        watch = asyncio.create_task(rt.supervise(on_down, on_up))
        try:
            os.kill(servers[f"model-{LOST}"], signal.SIGKILL)
            await eventually(
                lambda: len(events) == 2, "the replica down and up again", within_s=WAIT_S
            )
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        after = {r.name: r for r in rt.deployment.replicas}
        replaced_by = await rt.actor(LOST).pids.remote()
        kept_same_actor = rt.actor(KEPT) is kept_actor

    assert names == ["replica-0", "replica-1"]
    assert len(set(nodes.values())) == ray_cluster.nodes == 2
    assert len(pids) == 6
    assert events[0] == ("down", LOST)
    assert events[1] == ("up", after[LOST]) and after[LOST] != before[LOST]
    assert after[KEPT] == before[KEPT] and kept_same_actor
    assert not set(replaced_by.values()) & set(servers.values())
    assert wait_gone(list(servers.values()), timeout_s=10) == [], "the old actor's servers live on"
    left = [*pids, *replaced_by.values()]
    assert wait_gone(left, timeout_s=10) == [], "a replica's server outlived the runtime"


async def test_a_killed_replica_actor_is_replaced_alone_and_the_job_keeps_the_invariants(
    tmp_path: Path, ray_cluster: RayCluster
) -> None:
    # Long enough that rows are still waiting once the new actor is up, on a slow machine too.
    config = ray_job(tmp_path, ray_cluster, tasks=48)
    seen: dict[str, Any] = {}

    async def drive(trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics) -> RunSummary:
        assert isinstance(runtime, RayRuntime)
        job = asyncio.create_task(drive_quietly(trainer, runtime, metrics))
        await eventually(
            lambda: trainer.ledger.in_flight_count(LOST) > 0 and published(config.workdir) > 0,
            "rows on the replica and a snapshot",
            within_s=WAIT_S,
        )
        kept = (runtime.actor(KEPT), trainer.roster.endpoints(KEPT))
        before = trainer.roster.endpoints(LOST)
        seen["old_pids"] = list((await runtime.actor(LOST).pids.remote()).values())
        seen["killed_at"] = time.time()
        ray.kill(runtime.actor(LOST))

        def replaced() -> bool:
            return trainer.roster.is_up(LOST) and trainer.roster.endpoints(LOST) != before

        await eventually(
            lambda: not trainer.roster.is_up(LOST) or replaced(),
            "the replica down",
            within_s=WAIT_S,
        )
        seen["down_s"] = time.time() - seen["killed_at"]
        await eventually(replaced, "a new actor for the replica", within_s=WAIT_S)
        seen["new"] = trainer.roster.endpoints(LOST)
        await eventually(
            lambda: trainer.ledger.in_flight_count(LOST) > 0,
            "rows on the new actor",
            within_s=WAIT_S,
        )
        seen["kept_untouched"] = kept == (runtime.actor(KEPT), trainer.roster.endpoints(KEPT))
        return await job

    summary = await run_job(
        config.job_settings(),
        fresh=True,
        hooks=SimulatedTrainer(config.train.step_seconds),
        say=lambda _: None,
        drive=drive,
    )

    assert not summary.failed_groups
    assert seen["down_s"] < 5, f"the death took {seen['down_s']:.1f}s to notice"
    assert isinstance(seen["new"], ReplicaEndpoints)
    assert seen["kept_untouched"], "the replica that was not killed was restarted too"
    assert wait_gone(seen["old_pids"], timeout_s=10) == [], "the killed actor's servers live on"
    found = invariants.check_workdir(
        config.workdir,
        load_tasks_for(config.job_settings()),
        config.group_size,
        resumed_since=seen["killed_at"],
        full_reward="all",
    )
    assert found == [], invariants.report(found)


class Crash(Exception):
    """The first run's end: raised out of its drive once the cut we want is published."""


async def test_a_two_replica_snapshot_restores_onto_one_replica_actor(
    tmp_path: Path, ray_cluster: RayCluster
) -> None:
    # keep: the rerun's own snapshots must not prune the one it restored (read at the end).
    snapshot = {"every_seconds": 0.3, "keep": 100}
    two = ray_job(tmp_path, ray_cluster, tasks=24, snapshot=snapshot)
    store_dir = two.workdir / invariants.SNAPSHOT_STORE_DIR

    def cut_with_both_replicas() -> bool:
        latest = SnapshotStore(str(store_dir), clean_leftovers=False).latest()
        return latest is not None and {e.replica for e in latest.episodes} == {KEPT, LOST}

    async def crash_after_the_cut(
        trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics
    ) -> RunSummary:
        job = asyncio.create_task(drive_quietly(trainer, runtime, metrics))
        try:
            await eventually(
                cut_with_both_replicas,
                "a snapshot saving episodes on both replicas",
                within_s=WAIT_S,
            )
        finally:
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
        raise Crash

    with pytest.raises(Crash):
        await run_job(
            two.job_settings(),
            fresh=True,
            hooks=SimulatedTrainer(two.train.step_seconds),
            say=lambda _: None,
            drive=crash_after_the_cut,
        )

    one = ray_job(tmp_path, ray_cluster, tasks=24, replicas=1, snapshot=snapshot)
    said: list[str] = []
    since = time.time()
    summary = await run_job(
        one.job_settings(),
        fresh=False,
        hooks=SimulatedTrainer(one.train.step_seconds),
        say=said.append,
    )

    assert not summary.failed_groups
    (restoring,) = [line for line in said if line.startswith("restoring snapshot ")]
    store = SnapshotStore(str(store_dir), clean_leftovers=False)
    saved = store.load(restoring.removeprefix("restoring snapshot ").strip())
    moved = {e.rollout_id for e in saved.episodes if e.replica == LOST}
    assert moved, "the snapshot restored saved nothing on the replica that is gone"
    rollouts, unreadable = invariants.read_train_data(one.workdir)
    assert unreadable == []
    trained = {r.rollout_id: r for r in rollouts}
    # replica-1's saved episodes went on, on the one replica left, as their next attempt:
    # breaks if its records were not installed there (they would start over under new ids).
    for rollout_id in moved:
        assert rollout_id in trained, f"{rollout_id} of {LOST} was not continued"
        assert trained[rollout_id].attempt >= 1
    found = invariants.check_workdir(
        one.workdir,
        load_tasks_for(one.job_settings()),
        one.group_size,
        resumed_since=since,
        full_reward="all",
    )
    assert found == [], invariants.report(found)
