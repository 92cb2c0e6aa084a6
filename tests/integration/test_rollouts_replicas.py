"""The façade told that a replica is gone: ``Rollouts.replica_down`` on ``rollpoint serve``
servers, whose processes no trainer watches.

The servers run under ``rollpoint serve`` in a process group of their own; the test kills
one replica's three servers with SIGKILL mid-run, as a node lost under a scheduler would,
and reports it through the façade. The run must go on without it: every row trained once,
snapshots published after the loss (a participant that no longer answers would fail every
one of them), the loss in the run's event log.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import orjson
import pytest

from rollpoint import Rollouts, ServedDeployment, parse_config
from rollpoint.protocol.errors import ConfigError
from tests.support.processes import replica_servers
from tests.support.serve_process import served, workplace_serve_config

pytestmark = pytest.mark.integration

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
