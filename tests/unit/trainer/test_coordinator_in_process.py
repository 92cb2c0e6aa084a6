"""The snapshot coordinator and the resumer over in-process participants (no sockets)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollpoint.protocol.control import Phase
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store.snapshot_store import STAGING_DIR
from rollpoint.testing import Fault
from rollpoint.trainer.snapshot import coordinator as coordinator_module
from rollpoint.trainer.snapshot.cut import SavePhase
from rollpoint.trainer.snapshot.resumer import Resumer
from rollpoint.tuning import seam
from tests.unit.trainer.in_process_rig import Rig, build_rig

AGENT, RESOURCES = "agent@replica-0", "resources@replica-0"
COMMIT = "/rollpoint/v1/checkpoint/commit"
RESUME = "/rollpoint/v1/checkpoint/resume"


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = build_rig(tmp_path / "snapshots")
    yield r
    await r.aclose()


def all_idle(rig: Rig) -> bool:
    return set(rig.phases().values()) == {Phase.IDLE}


async def test_a_save_publishes_a_manifest_naming_every_participant(rig: Rig) -> None:
    episodes = rig.dispatch()
    report = await rig.coordinator().save()
    assert report.published, report.blocked_by
    assert (report.phase, report.blockers) == (SavePhase.PUBLISHED, [])
    manifest = rig.store.verify(report.snapshot_id)
    assert {(p.kind, p.replica) for p in manifest.participants} == {
        (kind, "replica-0") for kind in ParticipantKind
    }
    assert sorted(f"{e.rollout_id}#{e.attempt}" for e in manifest.episodes) == sorted(
        e.key for e in episodes
    )
    assert all_idle(rig)  # the pause ended: every participant resumed
    assert rig.barrier.is_open


async def test_a_save_holds_the_trainer_on_the_seam_from_the_barriers_close_to_its_reopening(
    rig: Rig,
) -> None:
    rig.dispatch()
    coordinator = rig.coordinator()
    heard: list[tuple[str, bool]] = []

    class Barrier(seam.CheckpointListener):
        def hold(self, source: object) -> None:
            if source is coordinator:
                heard.append(("hold", rig.barrier.is_open))

        def release(self, source: object) -> None:
            if source is coordinator:
                heard.append(("release", rig.barrier.is_open))

    with seam.listening(Barrier()):
        report = await coordinator.save()
    assert report.published, report.blocked_by
    assert heard == [("hold", False), ("release", True)]


async def test_a_participant_refusing_prepare_fails_the_save_and_names_it(rig: Rig) -> None:
    rig.dispatch()
    # Held by another checkpoint: it refuses the save's prepare (checkpoint_conflict).
    await rig.client(RESOURCES).prepare("someone-else", time.time() + 30)
    report = await rig.coordinator().save()
    assert not report.published
    assert RESOURCES in report.blocked_by and "someone-else" in report.blocked_by
    # Typed: who, in which verb, the wire's code, and that a later save may get past it.
    (blocker,) = report.blockers
    assert (blocker.participant, blocker.verb, blocker.code, blocker.retryable) == (
        RESOURCES,
        "prepare",
        "checkpoint_conflict",
        False,
    )
    assert report.phase is SavePhase.PREPARE
    assert rig.store.list_snapshots(include_invalid=True) == []
    phases = rig.phases()
    assert phases.pop(RESOURCES) is Phase.PREPARED  # still the other checkpoint's
    assert set(phases.values()) == {Phase.IDLE}  # the abort resumed the others


async def test_a_lost_commit_reply_publishes_no_half_snapshot(rig: Rig) -> None:
    rig.dispatch()
    rule = rig.faults(AGENT).add(Fault.drop_reply(path=COMMIT))
    report = await rig.coordinator().save()
    assert rule.hits == 1 and "commit" in rig.calls(AGENT)  # the agent did commit
    assert not report.published
    assert f"{AGENT} commit" in report.blocked_by
    (blocker,) = report.blockers
    assert (blocker.participant, blocker.verb, blocker.code, blocker.retryable) == (
        AGENT,
        "commit",
        "transport_error",
        True,
    )
    assert report.phase is SavePhase.COMMIT
    assert rig.store.list_snapshots(include_invalid=True) == []
    staging = rig.root / STAGING_DIR
    assert not staging.exists() or list(staging.iterdir()) == []  # aborted, not left half
    assert all_idle(rig)


async def test_the_resumer_retries_a_lost_resume_once(rig: Rig) -> None:
    for client in rig.clients:
        await client.prepare("c1", time.time() + 30)
    rule = rig.faults(AGENT).add(Fault.reset(path=RESUME))
    resumer = Resumer()
    await resumer.resume_all("c1", rig.clients)
    assert rule.hits == 1
    assert rig.calls(AGENT).count("resume") == 1  # the retry, the reset never arrived
    assert all_idle(rig) and resumer.unresumed == {}


async def test_the_resumer_remembers_an_unreachable_participant_and_resumes_it_later(
    rig: Rig,
) -> None:
    for client in rig.clients:
        await client.prepare("c1", time.time() + 30)
    rig.faults(AGENT).add(Fault.reset(path=RESUME, times=2))
    resumer = Resumer()
    await resumer.resume_all("c1", rig.clients)
    assert set(resumer.unresumed) == {AGENT}
    assert rig.fences[AGENT].phase is Phase.PREPARED
    await resumer.resume_leftovers(rig.clients)
    assert resumer.unresumed == {} and all_idle(rig)


async def test_the_resumer_reopens_callees_last(rig: Rig) -> None:
    for client in rig.clients:
        await client.prepare("c1", time.time() + 30)
    order: list[str] = []
    for label, participant in rig.participants.items():
        # Each participant notes when its admission reopens (the resume reached it).
        def opened(label: str = label, hook=participant.open_admission) -> object:
            order.append(label)
            return hook()

        participant.open_admission = opened  # type: ignore[method-assign]
    await Resumer().resume_all("c1", rig.clients)
    assert order == [RESOURCES, AGENT, "model@replica-0"]


async def test_a_save_behind_an_unreachable_leftover_names_each_one_before_any_pause(
    rig: Rig,
) -> None:
    rig.dispatch()
    coordinator = rig.coordinator()
    for client in rig.clients:
        await client.prepare("c1", time.time() + 30)
    rig.faults(AGENT).add(Fault.reset(path=RESUME, times=None))
    await coordinator._resumer.resume_all("c1", rig.clients)
    report = await coordinator.save()
    assert not report.published and report.phase is SavePhase.RESUME_LEFTOVERS
    assert [(b.participant, b.verb, b.code, b.retryable) for b in report.blockers] == [
        (AGENT, "resume", "transport_error", True)
    ]
    assert report.blocked_by == f"{AGENT} still closed by an earlier checkpoint and unreachable"
    assert report.pause_s == 0.0  # no prepare was sent: the barrier never closed


async def test_the_save_history_keeps_the_newest_reports_however_many_saves_ran(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Kept whole, the history held one report (and its manifest) per save, one a train step:
    # the trainer grew with rows trained (issue 33, the soak). A small bound keeps this fast.
    monkeypatch.setattr(coordinator_module, "HISTORY_KEEP", 4)
    rig.dispatch()
    coordinator = rig.coordinator()
    ids = []
    for _ in range(20):
        report = await coordinator.save()
        assert report.published, report.blocked_by
        ids.append(report.snapshot_id)
    assert coordinator.saves == coordinator.published_total == 20
    assert 4 <= len(coordinator.history) < 8
    assert [r.snapshot_id for r in coordinator.history] == ids[-len(coordinator.history) :]
    latest = coordinator.latest_published
    assert latest is not None and latest.snapshot_id == ids[-1]
    assert [r.snapshot_id for r in coordinator.reports_since(18)] == ids[18:]
    assert coordinator.published_with_episodes == 20  # every save held the dispatched rows


async def test_the_snapshot_a_run_restored_is_held_until_the_run_publishes_one(rig: Rig) -> None:
    """Chaos (the journal-mode campaign, trial 104): a rerun restored an older snapshot
    (the newer ones shared a damaged file), then every save failed while it trained on.
    Retention, still counting the damaged ones as the newest, deleted the train checkpoint
    the restored snapshot composes with, and the next rerun was refused. The coordinator
    holds the restored snapshot (pinned: retention keeps it and that checkpoint) through
    failed saves, and lets it go once it publishes a snapshot of its own."""
    rig.dispatch()
    restored = await rig.coordinator().save()
    assert restored.published
    coordinator = rig.coordinator()
    store = coordinator.store  # the run's own (pins are the process's)

    coordinator.hold_until_published(restored.snapshot_id)

    assert store.pinned == {restored.snapshot_id}
    await rig.client(RESOURCES).prepare("someone-else", time.time() + 30)
    failed = await coordinator.save()
    assert not failed.published
    assert store.pinned == {restored.snapshot_id}  # a failed save lets nothing go
    await rig.client(RESOURCES).resume("someone-else")
    own = await coordinator.save()
    assert own.published, own.blocked_by
    assert store.pinned == frozenset()
