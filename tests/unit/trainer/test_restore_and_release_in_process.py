"""The restorer and the release batcher over in-process participants (no sockets)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollpoint.protocol.control import Phase
from rollpoint.protocol.errors import RestoreError
from rollpoint.testing import Fault
from rollpoint.trainer.dispatch.release_batcher import ReleaseBatcher
from rollpoint.trainer.record.workdir_record import WorkdirRecord
from rollpoint.trainer.restore.restorer import Restorer
from rollpoint.trainer.restore.resume_point import ResumePoint
from rollpoint.trainer.state.ledger_record import RolloutState
from tests.unit.trainer.in_process_rig import Rig, build_rig

MODEL, AGENT, RESOURCES = "model@replica-0", "agent@replica-0", "resources@replica-0"
RESTORE = "/rollpoint/v1/checkpoint/restore"
RESUME = "/rollpoint/v1/checkpoint/resume"


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = build_rig(tmp_path / "snapshots")
    yield r
    await r.aclose()


async def saved(rig: Rig) -> ResumePoint:
    """A published snapshot of two tries one turn in, then the servers' state lost."""
    rig.dispatch()
    report = await rig.coordinator().save()
    assert report.published, report.blocked_by
    for participant in rig.participants.values():
        participant.state = {}
    return rig.resume_point(report.snapshot_id)


async def test_a_restore_installs_the_saved_state_onto_every_participant(
    rig: Rig, tmp_path: Path
) -> None:
    point = await saved(rig)
    run = await Restorer(rig.clients).restore(point, step_record=WorkdirRecord(tmp_path))
    continued = sorted(e.key for e in run.continued)
    assert continued == sorted(f"{e.rollout_id}#{e.attempt + 1}" for e in point.manifest.episodes)
    for label, participant in rig.participants.items():
        assert sorted(participant.state) == continued, label
        assert set(participant.state.values()) == {1}, label
    assert set(rig.phases().values()) == {Phase.IDLE}  # resumed after the install


async def test_a_lost_restore_reply_is_asked_for_again_and_the_restore_holds(
    rig: Rig, tmp_path: Path
) -> None:
    point = await saved(rig)
    rule = rig.faults(AGENT).add(Fault.drop_reply(path=RESTORE))

    run = await Restorer(rig.clients).restore(point, step_record=WorkdirRecord(tmp_path))

    assert rule.hits == 1
    # The agent restored on the first request; the second got the reply it had lost.
    assert rig.calls(AGENT).count("restore") == 2
    continued = sorted(e.key for e in run.continued)
    assert sorted(rig.participants[AGENT].state) == continued
    assert set(rig.phases().values()) == {Phase.IDLE}


async def test_a_restore_whose_resume_fails_once_resumes_again_at_once(
    rig: Rig, tmp_path: Path
) -> None:
    # The saves' resume path: one retry, so the agent reopens now, not when its lease lapses.
    point = await saved(rig)
    rule = rig.faults(AGENT).add(Fault.reset(path=RESUME))
    resumes = rig.calls(AGENT).count("resume")  # the save's

    await Restorer(rig.clients).restore(point, step_record=WorkdirRecord(tmp_path))

    assert rule.hits == 1
    # The reset one never reached the agent; the one after it did.
    assert rig.calls(AGENT).count("resume") == resumes + 1
    assert set(rig.phases().values()) == {Phase.IDLE}


async def left_mid_snapshot(rig: Rig, checkpoint_id: str, lease_s: float) -> None:
    """Every participant prepared and committed ``checkpoint_id`` (detached), as a trainer
    killed before its resume leaves them: held in phase committed until the lease lapses."""
    deadline = time.time() + lease_s
    for client in rig.clients:
        await client.prepare(checkpoint_id, deadline)
    for client in rig.clients:
        await client.commit(checkpoint_id, deadline, "dead-trainer", [], wait_for_write=False)
    assert set(rig.phases().values()) == {Phase.COMMITTED}


async def test_a_restore_waits_for_the_lease_of_a_checkpoint_a_killed_trainer_left(
    tmp_path: Path,
) -> None:
    rig = build_rig(tmp_path / "snapshots", lease_grace_s=0.1)
    try:
        point = await saved(rig)
        await left_mid_snapshot(rig, "snap-of-the-dead-trainer", lease_s=0.5)

        run = await Restorer(rig.clients).restore(point, step_record=WorkdirRecord(tmp_path))

        continued = sorted(e.key for e in run.continued)
        for label, participant in rig.participants.items():
            assert sorted(participant.state) == continued, label
            # The restore came after the lease reopened it: it never met a conflict.
            assert rig.fences[label].checkpoint_id is None, label
        assert set(rig.phases().values()) == {Phase.IDLE}
    finally:
        await rig.aclose()


async def test_a_lease_that_lapses_just_past_the_restore_deadline_is_waited_out(
    tmp_path: Path,
) -> None:
    # Chaos trial 670: a rerun started within the lease grace of a killed restore, whose
    # lease (its deadline plus the grace) lapses after the rerun's own deadline.
    rig = build_rig(tmp_path / "snapshots", lease_grace_s=0.1)
    try:
        point = await saved(rig)
        await left_mid_snapshot(rig, "restore-of-the-killed-rerun", lease_s=0.6)

        run = await Restorer(rig.clients).restore(
            point, step_record=WorkdirRecord(tmp_path), deadline_s=0.3
        )

        continued = sorted(e.key for e in run.continued)
        assert continued
        for label, participant in rig.participants.items():
            assert sorted(participant.state) == continued, label
        assert set(rig.phases().values()) == {Phase.IDLE}
    finally:
        await rig.aclose()


async def test_a_lease_that_outlasts_the_restore_deadline_fails_it_naming_the_holders(
    rig: Rig, tmp_path: Path
) -> None:
    point = await saved(rig)
    await left_mid_snapshot(rig, "snap-of-the-dead-trainer", lease_s=30)

    with pytest.raises(RestoreError) as caught:
        await Restorer(rig.clients).restore(
            point, step_record=WorkdirRecord(tmp_path), deadline_s=0.3
        )

    message = caught.value.message
    assert "restore not started" in message and "nothing was installed" in message
    assert f"{AGENT} (committed for snap-of-the-dead-trainer)" in message
    assert all(participant.state == {} for participant in rig.participants.values())
    assert all("restore" not in rig.calls(label) for label in rig.participants)
    # Still the dead trainer's: only its lease ends it.
    assert set(rig.phases().values()) == {Phase.COMMITTED}


async def test_a_failing_participant_fails_the_restore_and_every_participant_is_resumed(
    rig: Rig, tmp_path: Path
) -> None:
    point = await saved(rig)
    rig.participants[RESOURCES].fail.add("install")
    with pytest.raises(RestoreError, match=f"failed, nothing kept: {RESOURCES}"):
        await Restorer(rig.clients).restore(point, step_record=WorkdirRecord(tmp_path))
    assert set(rig.phases().values()) == {Phase.IDLE}
    for label in (MODEL, AGENT):  # restored, then resumed by the one cleanup path
        assert rig.calls(label)[-1] == "resume", label
        # The next attempts can never run: their marks are up everywhere.
        marks = rig.fences[label].retire_marks
        assert {marks[e.rollout_id] for e in point.manifest.episodes} == {1}, label


async def test_acks_retires_and_forgets_reach_the_participants(rig: Rig) -> None:
    sealed, given_up = rig.dispatch(rows=2)
    agent = rig.participants[AGENT]
    agent.finished_unacked = [sealed]
    rig.ledger.abandon(given_up.rollout_id)
    releases = ReleaseBatcher(rig.clients, rig.ledger, barrier=rig.barrier)
    releases.sealed(sealed, "replica-0")
    await releases.flush()
    assert agent.finished_unacked == [] and releases.acked == 1
    for label, participant in rig.participants.items():
        assert participant.calls["retire"] == 1, label
        assert rig.fences[label].retire_marks.get(given_up.rollout_id) == given_up.attempt
        assert participant.calls["forget"] == 1, label  # the sealed rollout, at once
    assert rig.ledger.get(given_up.rollout_id).state is RolloutState.RETIRED
    assert releases.forgotten == 1


async def test_a_participant_busy_with_a_checkpoint_keeps_the_batch_for_later(rig: Rig) -> None:
    (episode,) = rig.dispatch(rows=1)
    await rig.client(RESOURCES).prepare("busy", time.time() + 30)
    releases = ReleaseBatcher(rig.clients, rig.ledger, barrier=rig.barrier)
    releases.sealed(episode, "replica-0")
    await releases.flush()
    assert releases.forgotten == 0  # refused (409) by the prepared participant: kept
    assert rig.participants[RESOURCES].calls["forget"] == 0
    await rig.client(RESOURCES).resume("busy")
    await releases.flush()
    assert releases.forgotten == 1
    assert {p.calls["forget"] for p in rig.participants.values()} == {1, 2}
    assert rig.participants[RESOURCES].calls["forget"] == 1
