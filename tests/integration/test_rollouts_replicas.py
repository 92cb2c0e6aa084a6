"""The façade told that a replica is gone, and back: ``Rollouts.replica_down`` and
``replica_up`` on ``rollpoint serve`` servers, whose processes no trainer watches.

The servers run under ``rollpoint serve`` in a process group of their own; the test kills
one replica's three servers with SIGKILL mid-run, as a node lost under a scheduler would,
and reports it through the façade. The run must go on without it: every row trained once,
snapshots published after the loss (a participant that no longer answers would fail every
one of them), the loss in the run's event log. For ``replica_up`` the test then plays the
operator's orchestration: it starts that replica's three servers again, empty, with the
served tokens and snapshot store, and hands their URLs over; the tries the snapshot saved
there continue on them.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import orjson
import pytest

from rollpoint import ReplicaEndpoints, Rollouts, ServedDeployment, load_config, parse_config
from rollpoint.http.auth import CONTROL_TOKEN_ENV, DATA_TOKEN_ENV
from rollpoint.protocol.errors import ConfigError
from rollpoint.runtime.process_group import ProcessGroup
from rollpoint.runtime.replica_plan import ReplicaPlan, replica_index, start_replica
from tests.support.processes import replica_servers
from tests.support.serve_process import served, workplace_serve_config

pytestmark = pytest.mark.process

TASKS, GROUP_SIZE = 12, 2
LOST = "replica-1"


async def test_a_replica_reported_down_is_left_out_and_every_row_trains_once(
    tmp_path: Path,
) -> None:
    serve_config, servers = workplace_serve_config(
        tmp_path, tasks=TASKS, group_size=GROUP_SIZE, latency_ms=100
    )
    config = parse_config(
        {
            "workdir": str(tmp_path / "trainer"),
            "environment": "workplace",
            "tasks": TASKS,
            "group_size": GROUP_SIZE,
            "replicas": 2,
            "concurrency": 8,
            "train": {"batch_size": 4},
            "snapshot": {"every_seconds": 0.5},
        }
    )
    config.workdir.mkdir()
    with served(serve_config) as line:
        deployment = ServedDeployment.model_validate(line)
        async with Rollouts(config, deployment=deployment) as run:
            with pytest.raises(ConfigError, match="no replica 'replica-9' in this run"):
                await run.replica_down("replica-9")
            lost_at = None
            async for batch in run.batches():
                if lost_at is None:
                    victims = replica_servers(servers, LOST)
                    assert len(victims) == 3, victims  # its agent, model and resources
                    for pid in victims:
                        os.kill(pid, signal.SIGKILL)
                    lost_at = time.time()
                    await run.replica_down(LOST)
                    await run.replica_down(LOST)  # idempotent
                batch.done()
            summary = await run.summary()

    trained = [
        orjson.loads(x) for x in (config.workdir / "train_data.jsonl").read_bytes().splitlines()
    ]
    assert len({(r["group_id"], r["row"]) for r in trained}) == len(trained) == TASKS * GROUP_SIZE
    assert summary.episodes == TASKS * GROUP_SIZE
    events = [
        orjson.loads(x) for x in (config.workdir / "run_events.jsonl").read_bytes().splitlines()
    ]
    assert [e["replica"] for e in events if e.get("kind") == "replica_down"] == [LOST]
    saves = [
        orjson.loads(x)
        for x in (config.workdir / "metrics.jsonl").read_bytes().splitlines()
        if b'"event":"snapshot"' in x
    ]
    assert lost_at is not None
    assert any(s["outcome"] == "published" and s["ts"] > lost_at + 0.5 for s in saves), saves


def served_tokens(deployment: ServedDeployment) -> dict[str, str]:
    """The tokens ``rollpoint serve`` wrote, as its servers take them (environment)."""
    assert deployment.data_token_file is not None
    return {
        CONTROL_TOKEN_ENV: Path(deployment.control_token_file).read_text().strip(),
        DATA_TOKEN_ENV: Path(deployment.data_token_file).read_text().strip(),
    }


async def start_again(
    serve_config: Path, deployment: ServedDeployment, name: str, logs: Path
) -> tuple[ProcessGroup, ReplicaEndpoints]:
    """Replica ``name``'s three servers started again, empty, on new ports: what an
    operator's orchestration does for a node it lost, with the served tokens and store."""
    env = served_tokens(deployment)
    plan = ReplicaPlan.of(
        load_config(serve_config).runtime_settings(),
        policy_url=deployment.policy_url,
        snapshot_root=deployment.snapshot_store,
    )
    group = ProcessGroup(logs, env=env)
    try:
        return group, await start_replica(group, plan, replica_index(name), restarted=True)
    except BaseException:
        await group.stop()
        raise


async def test_a_replica_reported_back_continues_the_tries_its_snapshot_saved(
    tmp_path: Path,
) -> None:
    serve_config, servers = workplace_serve_config(
        tmp_path, tasks=TASKS, group_size=GROUP_SIZE, latency_ms=300
    )
    config = parse_config(
        {
            "workdir": str(tmp_path / "trainer"),
            "environment": "workplace",
            "tasks": TASKS,
            "group_size": GROUP_SIZE,
            "replicas": 2,
            "concurrency": 8,
            "train": {"batch_size": 4},
        }
    )
    config.workdir.mkdir()
    group: ProcessGroup | None = None
    after_up = 0.0
    try:
        with served(serve_config) as line:
            deployment = ServedDeployment.model_validate(line)
            async with Rollouts(config, deployment=deployment) as run:
                saved_there = 0
                async for batch in run.batches():
                    if group is None:
                        report = await run.snapshot()
                        assert report.published and report.manifest is not None
                        saved_there = sum(e.replica == LOST for e in report.manifest.episodes)
                        for pid in replica_servers(servers, LOST):
                            os.kill(pid, signal.SIGKILL)
                        await run.replica_down(LOST)
                        group, endpoints = await start_again(
                            serve_config, deployment, LOST, tmp_path / "again"
                        )
                        await run.replica_up(endpoints)
                        after_up = time.time()
                    batch.done()
                summary = await run.summary()
    finally:
        if group is not None:
            await group.stop()

    assert saved_there > 0, "the snapshot before the kill held no episode on the lost replica"
    trained = [
        orjson.loads(x) for x in (config.workdir / "train_data.jsonl").read_bytes().splitlines()
    ]
    assert len({(r["group_id"], r["row"]) for r in trained}) == len(trained) == TASKS * GROUP_SIZE
    assert summary.episodes == TASKS * GROUP_SIZE
    events = [
        orjson.loads(x) for x in (config.workdir / "run_events.jsonl").read_bytes().splitlines()
    ]
    (up,) = [e for e in events if e.get("kind") == "replica_up"]
    (down,) = [e for e in events if e.get("kind") == "replica_down"]
    # Every try held at the loss continues from the snapshot: those it saved there,
    # but for any that finished between the snapshot and the kill (300 ms a call).
    assert up["replica"] == down["replica"] == LOST
    assert 0 < up["restored"] == down["held"] <= saved_there, (down, up, saved_there)
    # Continued there: attempt 1 of rollouts whose earlier turns are attempt 0's.
    continued = [r for r in trained if r["attempt"] >= 1]
    assert len(continued) >= up["restored"]
    # And the replica is a participant again: a snapshot after its return holds its parts.
    saves = [
        orjson.loads(x)
        for x in (config.workdir / "metrics.jsonl").read_bytes().splitlines()
        if b'"event":"snapshot"' in x
    ]
    assert any(s["outcome"] == "published" and s["ts"] > after_up for s in saves), saves
