"""The coordinator's first look at its participants, as a run starts, against real servers.

A participant unreachable for a moment must not end the run, and a replica that dies while
the coordinator is still asking must be dropped, not waited for at its old address until
the deadline (a chaos trial caught that: a replica killed 0.09 s into a run stopped it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollpoint.app.config import RunConfig, SnapshotConfig, TrainConfig
from rollpoint.http.auth import CONTROL_TOKEN_ENV
from rollpoint.http.client import HttpClient
from rollpoint.loop import SimulatedTrainer
from rollpoint.protocol.errors import SnapshotError
from rollpoint.testing import LocalCluster
from rollpoint.trainer.trainer import Trainer

pytestmark = pytest.mark.integration

TOKEN = "discovery-test-token"


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    with LocalCluster(replicas=2, snapshot_root=str(tmp_path / "snapshots")) as c:
        yield c


def config(tmp_path: Path, deadline_s: float) -> RunConfig:
    return RunConfig(
        workdir=tmp_path / "run",
        environment="workplace",
        group_size=2,
        replicas=2,
        train=TrainConfig(batch_size=4),
        snapshot=SnapshotConfig(deadline_seconds=deadline_s),
    )


async def test_a_replica_that_dies_during_discovery_is_dropped_not_waited_for(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.replicas[1].model.stop()  # replica-1 is dead; the runtime has not said so yet
    async with HttpClient(token=TOKEN) as http:
        control = cluster.control_plane(http, tmp_path)
        trainer = Trainer(
            config(tmp_path, 30).trainer_settings(),
            cluster.deployment(),
            cluster.tasks(1),
            hooks=SimulatedTrainer(),
            control=control,
        )
        assert trainer.coordinator is not None
        asking = asyncio.create_task(trainer.coordinator.discover())
        await asyncio.sleep(0.5)
        assert not asking.done(), "it must keep asking the unreachable participant"
        await trainer.replica_down("replica-1")
        statuses = await asyncio.wait_for(asking, timeout=5)  # far inside the 30 s deadline
        control.metrics.close()
    assert {s.replica for s in statuses} == {"replica-0"}
    assert len(statuses) == 3


async def test_a_participant_unreachable_past_the_deadline_is_named(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.replicas[1].model.stop()
    async with HttpClient(token=TOKEN) as http:
        control = cluster.control_plane(http, tmp_path)
        trainer = Trainer(
            config(tmp_path, 0.5).trainer_settings(),
            cluster.deployment(),
            cluster.tasks(1),
            hooks=SimulatedTrainer(),
            control=control,
        )
        assert trainer.coordinator is not None
        with pytest.raises(SnapshotError, match=r"model@replica-1 did not answer status"):
            await trainer.coordinator.discover()
        control.metrics.close()
