"""Elastic restore: a snapshot taken with N replicas restores onto M replicas.

A job crashes; the operator reruns it with another ``replicas`` count on fresh servers
(threads on loopback). Every saved episode lands on a live replica and continues from its
saved turn, the run finishes with the crash invariants (docs/design.md#invariants) holding,
and state that is not portable is refused, naming it, before anything is installed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from rollpoint.app.config import RunConfig
from rollpoint.http.client import HttpClient
from rollpoint.protocol.control import Phase, StatusReply
from rollpoint.protocol.errors import InvalidCheckpointStateError, RestoreError
from rollpoint.protocol.manifest import ParticipantEntry, SnapshotManifest
from rollpoint.protocol.participant import CheckpointMode, ParticipantKind
from rollpoint.store.snapshot_store import SNAPSHOTS_DIR, SnapshotStore
from rollpoint.testing import invariants
from rollpoint.trainer.record.workdir_record import WorkdirRecord
from rollpoint.trainer.restore.installer import PARTICIPANTS_SUBDIR
from rollpoint.trainer.restore.restore_checks import check_config, place
from rollpoint.trainer.restore.restorer import Restorer
from rollpoint.trainer.restore.resume_point import ResumePoint, choose_resume_point
from rollpoint.trainer.state.ledger_record import RolloutState
from tests.scenarios.scenario_kit import (
    ControlCall,
    ScenarioCluster,
    crash,
    job,
    job_config,
    save_with_episodes,
    statuses,
)
from tests.support.polling import eventually

pytestmark = pytest.mark.integration


def configs(tmp_path: Path, before: int, after: int, **overrides: Any) -> tuple[RunConfig, ...]:
    """The crashed job's config and the rerun's: the same job but for ``replicas``."""
    workdir = tmp_path / "run"
    first = job_config(workdir, replicas=before, **overrides)
    return first, job_config(workdir, replicas=after, **overrides)


def resume_point(config: RunConfig, root: Path) -> ResumePoint:
    store = SnapshotStore(str(root), keep=config.snapshot.keep)
    point = choose_resume_point(store, WorkdirRecord(config.workdir))
    assert point is not None
    return point


def continued_from_the_cut(rows: list[dict[str, Any]], manifest: SnapshotManifest) -> set[str]:
    """The saved episodes trained as ``attempt + 1`` whose pre-cut turns were answered by
    the saved attempt (they continued at their saved turn, not from the prompt). One saved
    before its first turn completed has no pre-cut turn: its continuation starts at turn 0
    (CI met one: the cut came as its first policy call was on the wire)."""
    saved = {e.rollout_id: e for e in manifest.episodes}
    found = set()
    for row in rows:
        episode = saved.get(row["rollout_id"])
        if episode is None or row["attempt"] != episode.attempt + 1:
            continue
        early = [c["attempt"] for c in row["model_calls"] if c["turn"] < episode.turns_completed]
        pre_cut = {episode.attempt} if episode.turns_completed else set()
        if len(early) == episode.turns_completed and set(early) == pre_cut:
            found.add(row["rollout_id"])
    return found


def check_invariants(config: RunConfig, cluster: ScenarioCluster, since: float) -> None:
    tasks = cluster.tasks(config.tasks or 1, config.seed)
    found = invariants.check_workdir(
        config.workdir, tasks, config.group_size, resumed_since=since, full_reward="none"
    )
    assert found == [], invariants.report(found)


async def test_a_two_replica_snapshot_restores_onto_one_replica(tmp_path: Path) -> None:
    # 24 tasks (48 rows, 12 waves of 4): a loaded run of 6 finished before any save caught
    # an episode mid-conversation on both replicas.
    two, one = configs(tmp_path, 2, 1, tasks=24)
    root = two.workdir / "snapshots"
    async with ScenarioCluster(root, replicas=2) as first, job(first, two) as j:
        run = await j.start(in_flight=3)
        report = await save_with_episodes(j, {"replica-0", "replica-1"})
        await crash(run)
    assert report.manifest is not None
    point = resume_point(two, root)
    # `replicas` may change: before this, the rerun was refused here.
    check_config(point.manifest, one.fingerprint())
    moved = {e.rollout_id for e in point.manifest.episodes if e.replica == "replica-1"}
    assert moved
    async with ScenarioCluster(root, replicas=1) as fresh, HttpClient(token=fresh.token) as http:
        since = time.time()
        # A source the snapshot has no folder for: refused before anything moves.
        (agent,) = [c for c in fresh.clients(http) if c.address.kind is ParticipantKind.AGENT]
        folder = f"{SNAPSHOTS_DIR}/{point.manifest.snapshot_id}/{PARTICIPANTS_SUBDIR}"
        with pytest.raises(InvalidCheckpointStateError):
            await agent.restore(
                "restore-1",
                time.time() + 5,
                folder,
                [],
                point.manifest.checkpoint_id,
                ["replica-0", "replica-7"],
            )
        assert (await agent.status()).phase is Phase.IDLE
        restored = await Restorer(fresh.clients(http)).restore(
            point, step_record=WorkdirRecord(one.workdir)
        )
        assert restored.placement == {"replica-0": "replica-0", "replica-1": "replica-0"}
        assert len(restored.continued) == len(point.manifest.episodes)
        # Every continued episode is pinned to the one live replica, at its next attempt.
        for episode in restored.continued:
            record = restored.ledger.get(episode.rollout_id)
            assert (record.state, record.replica) == (RolloutState.QUEUED, "replica-0")
        # The lone agent now holds replica-1's sessions too, waiting for their next attempt.
        status = await statuses(fresh.clients(http))
        assert status["agent@replica-0"].counts["restored"] == len(restored.continued)
        async with job(fresh, one, restored=restored) as again:
            summary = await again.trainer.run()
        check_invariants(one, fresh, since)
    assert summary.failed_groups == {}
    rows = again.train_rows()
    continued = continued_from_the_cut(rows, point.manifest)
    # Breaks if replica-1's records were not installed on replica-0 (they would start over).
    assert moved <= continued, sorted(moved - continued)


async def test_a_one_replica_snapshot_restores_onto_two_replicas(tmp_path: Path) -> None:
    one, two = configs(tmp_path, 1, 2)
    root = one.workdir / "snapshots"
    async with ScenarioCluster(root, replicas=1) as first, job(first, one) as j:
        run = await j.start(in_flight=2)
        await save_with_episodes(j, {"replica-0"})
        await crash(run)
    point = resume_point(one, root)
    check_config(point.manifest, two.fingerprint())
    async with ScenarioCluster(root, replicas=2) as fresh, HttpClient(token=fresh.token) as http:
        since = time.time()
        restored = await Restorer(fresh.clients(http)).restore(
            point, step_record=WorkdirRecord(two.workdir)
        )
        assert restored.placement == {"replica-0": "replica-0"}
        assert all(
            restored.ledger.get(e.rollout_id).replica == "replica-0" for e in restored.continued
        )
        async with job(fresh, two, restored=restored) as again:
            summary = await again.trainer.run()
        check_invariants(two, fresh, since)
    assert summary.failed_groups == {}
    continued = continued_from_the_cut(again.train_rows(), point.manifest)
    assert continued == {e.rollout_id for e in point.manifest.episodes}
    # /metrics counts the restore and what it did with the snapshot's episodes.
    sample = again.metrics.registry.get_sample_value
    assert sample("rollpoint_restores_total", {"kind": "start"}) == 1
    assert sample("rollpoint_restored_episodes_total", {"outcome": "continued"}) == len(
        restored.continued
    )
    assert sample("rollpoint_restored_episodes_total", {"outcome": "restarted"}) == (
        restored.restarted
    )


async def test_state_that_is_not_portable_refuses_to_move_before_anything_is_installed(
    tmp_path: Path,
) -> None:
    snapshot = {"keep": 100, "deadline_seconds": 5, "allow_restart_only": True}
    two, one = configs(tmp_path, 2, 1, environment="math", snapshot=snapshot)
    root = two.workdir / "snapshots"
    async with (
        ScenarioCluster(root, replicas=2, environment="math") as first,
        job(first, two) as j,
    ):
        run = await j.start(in_flight=2)

        async def published() -> bool:
            return (await j.coordinator.save()).published

        await eventually(published, "a published snapshot")
        await crash(run)
    point = resume_point(two, root)
    async with (
        ScenarioCluster(root, replicas=1, environment="math") as fresh,
        HttpClient(token=fresh.token) as http,
    ):
        calls: list[ControlCall] = []
        with pytest.raises(RestoreError) as refused:
            await Restorer(fresh.clients(http, spy=calls)).restore(
                point, step_record=WorkdirRecord(one.workdir)
            )
        after = await statuses(fresh.clients(http))
    message = refused.value.message
    assert "\n" not in message, message
    assert "not portable" in message and "nothing was installed" in message
    for named in ("agent 'agent'", "resources 'resources'"):
        assert f"{named} (restart_only) of replica-1 onto replica-0" in message, message
    # Nothing was installed: no restore call went out, every participant is still idle.
    assert [c.verb for c in calls if c.verb != "status"] == []
    assert {s.phase for s in after.values()} == {Phase.IDLE}
    # The same snapshot onto as many replicas as it was taken with is not refused.
    async with (
        ScenarioCluster(root, replicas=2, environment="math") as same,
        HttpClient(token=same.token) as http,
    ):
        restored = await Restorer(same.clients(http)).restore(
            point, step_record=WorkdirRecord(two.workdir)
        )
    assert restored.placement == {"replica-0": "replica-0", "replica-1": "replica-1"}


def test_saved_replicas_missing_live_are_spread_over_the_least_loaded() -> None:
    """Placement alone (no servers): 3 saved replicas onto 2 live ones."""
    kinds = (ParticipantKind.MODEL, ParticipantKind.AGENT, ParticipantKind.RESOURCES)
    saved = [f"replica-{i}" for i in range(3)]
    manifest = SnapshotManifest(
        snapshot_id="snap-1",
        checkpoint_id="snap-1",
        created_at=0.0,
        train_step=0,
        policy_version=0,
        pause_seconds=0.0,
        topology_fingerprint="0" * 64,
        participants=[
            ParticipantEntry(
                kind=kind,
                name=kind.value,
                replica=replica,
                mode=CheckpointMode.TURN,
                instance=f"{kind.value}-{replica}",
                manifest_path=f"participants/{kind.value}/{kind.value}-{replica}/manifest.json",
            )
            for replica in saved
            for kind in kinds
        ],
        episodes=[],
        restarts=[],
        finished=[],
        files={},
        config_fingerprint={},
    )

    def live(replicas: list[str], without: ParticipantKind | None = None) -> dict[Any, Any]:
        return {
            (kind.value, kind.value, replica): StatusReply(
                kind=kind,
                name=kind.value,
                replica=replica,
                mode=CheckpointMode.TURN,
                protocol_version=1,
                features=[],
                phase=Phase.IDLE,
                checkpoint_id=None,
                lease_expires_at=None,
                counts={},
                retired_rollouts=0,
            )
            for replica in replicas
            for kind in kinds
            if kind is not without
        }

    placement = place(manifest, live(["replica-1", "replica-0"]))
    assert placement.target_of == {
        "replica-0": "replica-0",
        "replica-1": "replica-1",
        "replica-2": "replica-0",
    }
    assert placement.sources("replica-0") == ["replica-0", "replica-2"]
    assert place(manifest, live(["a", "b"])).target_of == {
        "replica-0": "a",
        "replica-1": "b",
        "replica-2": "a",
    }
    with pytest.raises(
        RestoreError, match="model 'model' of replica-0, model 'model' of replica-1"
    ):
        place(manifest, live(["replica-0", "replica-1"], without=ParticipantKind.MODEL))
