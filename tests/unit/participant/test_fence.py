"""The fence: every legal transition, every refusal, replays, the lease and retire marks."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rollpoint.participant import checkpoint_write as checkpoint_write_module
from rollpoint.participant import state_folders as state_folders_module
from rollpoint.participant.control_settings import ControlSettings
from rollpoint.participant.fence import Fence
from rollpoint.participant.phase_table import TRANSITIONS, next_phase
from rollpoint.protocol.control import (
    MAX_REPORTED_BLOCKERS,
    AckRequest,
    CommitRequest,
    ConfirmRequest,
    ForgetRequest,
    Phase,
    PrepareRequest,
    RenewRequest,
    RestoreRequest,
    ResumeRequest,
    RetireOutcomeKind,
    RetireRequest,
    Verb,
)
from rollpoint.protocol.errors import (
    BadRequestError,
    CheckpointConflictError,
    ConfigError,
    DeadlineExceededError,
    InvalidCheckpointStateError,
    InvalidPhaseError,
    NotFoundError,
    RestoreError,
    RollpointError,
    SnapshotError,
    StaleAttemptError,
    StaleCheckpointError,
)
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.manifest import JournalMark
from rollpoint.store.participant_state import read_participant_state
from rollpoint.tuning import collector_schedule as collector_schedule_module
from rollpoint.tuning import seam
from rollpoint.tuning.collector_listener import installed
from rollpoint.tuning.collector_schedule import (
    COLLECTOR_RELEASE_DELAY_S,
    MAX_GAP_S,
    CollectorSchedule,
)
from tests.support.records import records_paths
from tests.unit.participant.fake_participant import FakeClock, FakeParticipant

E = EpisodeId.from_key


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "snapshots"


@pytest.fixture
def participant() -> FakeParticipant:
    p = FakeParticipant()
    p.state = {"r1#0": 3, "r2#0": 1}
    return p


@pytest.fixture
async def fence(participant: FakeParticipant, root: Path) -> AsyncIterator[Fence]:
    # As a server process runs it: its entry point installed the collector's listener.
    with installed():
        f = Fence(
            participant, ControlSettings(token="t", snapshot_root=str(root), lease_grace_s=2.0)
        )
        yield f
        await f.aclose()


def soon(seconds: float = 5.0) -> float:
    return time.time() + seconds


def prepare(cid: str = "c1", deadline: float | None = None) -> PrepareRequest:
    return PrepareRequest(checkpoint_id=cid, deadline_ts=deadline or soon())


def commit(
    cid: str = "c1", directory: str = "snap-1", scope: tuple[str, ...] = ("r1#0", "r2#0")
) -> CommitRequest:
    return CommitRequest(
        checkpoint_id=cid,
        deadline_ts=soon(),
        checkpoint_dir=directory,
        episode_ids=[E(k) for k in scope],
    )


def restore(
    cid: str = "c1",
    directory: str = "snap-1",
    scope: tuple[str, ...] = ("r1#0", "r2#0"),
    source: str | None = None,
) -> RestoreRequest:
    return RestoreRequest(
        checkpoint_id=cid,
        deadline_ts=soon(),
        checkpoint_dir=directory,
        episode_ids=[E(k) for k in scope],
        source_checkpoint_id=source,
    )


def observable(fence: Fence, participant: FakeParticipant) -> dict[str, Any]:
    return {
        "phase": fence.phase,
        "checkpoint_id": fence.checkpoint_id,
        "lease": fence.lease_expires_at,
        "marks": fence.retire_marks,
        **participant.snapshot(),
    }


async def refused(
    fence: Fence, participant: FakeParticipant, call: Any, error: type[RollpointError]
) -> RollpointError:
    """Run a call that must be refused with ``error`` and change nothing."""
    before = observable(fence, participant)
    with pytest.raises(error) as info:
        await call
    assert observable(fence, participant) == before
    return info.value


# --- the table --------------------------------------------------------------------------


def test_table_only_leaves_idle_by_prepare_or_restore() -> None:
    assert {s for (p, s), after in TRANSITIONS.items() if p is Phase.IDLE and after is not p} == {
        Verb.PREPARE,
        Verb.RESTORE,
    }


def test_illegal_step_names_the_valid_phases() -> None:
    with pytest.raises(InvalidPhaseError, match=r"commit is not valid in phase idle.*prepared"):
        next_phase(Phase.IDLE, Verb.COMMIT)


def test_a_participant_whose_name_cannot_name_a_folder_is_refused() -> None:
    with pytest.raises(ConfigError, match="must be identifiers"):
        Fence(FakeParticipant(name="../up"), ControlSettings(token="t", snapshot_root="/tmp/x"))


def test_settings_refuse_an_empty_token_and_a_negative_grace() -> None:
    with pytest.raises(ConfigError, match="no control token configured"):
        ControlSettings(token=" ", snapshot_root="/tmp/x")
    with pytest.raises(ConfigError, match="lease_grace_s"):
        ControlSettings(token="t", snapshot_root="/tmp/x", lease_grace_s=-1)
    assert "secret" not in repr(ControlSettings(token="secret", snapshot_root="/tmp/x"))


# --- prepare ----------------------------------------------------------------------------


async def test_prepare_when_ready_closes_admission_and_holds_a_lease(
    fence: Fence, participant: FakeParticipant
) -> None:
    deadline = soon()
    reply = await fence.prepare(prepare(deadline=deadline))
    assert reply.phase is Phase.PREPARED and reply.report.ready
    assert fence.phase is Phase.PREPARED and fence.checkpoint_id == "c1"
    assert not participant.admission_open
    assert reply.lease_expires_at == fence.lease_expires_at == deadline + 2.0
    status = fence.status()
    assert (status.phase, status.checkpoint_id, status.lease_expires_at) == (
        Phase.PREPARED,
        "c1",
        deadline + 2.0,
    )


async def test_prepare_replay_returns_the_recorded_reply(
    fence: Fence, participant: FakeParticipant
) -> None:
    first = await fence.prepare(prepare())
    again = await fence.prepare(prepare())
    assert again == first
    assert participant.calls["close_admission"] == 1


async def test_prepare_not_ready_by_deadline_reports_capped_blockers_and_stays_closed(
    fence: Fence, participant: FakeParticipant
) -> None:
    participant.set_blockers([f"r{i}#0" for i in range(150)])
    reply = await fence.prepare(prepare(deadline=soon(0.05)))
    assert reply.phase is Phase.PREPARING and not reply.report.ready
    assert len(reply.report.blockers) == MAX_REPORTED_BLOCKERS
    assert reply.report.blocker_count == 150
    assert fence.phase is Phase.PREPARING and not participant.admission_open


async def test_prepare_waits_for_readiness_instead_of_polling(
    fence: Fence, participant: FakeParticipant
) -> None:
    participant.set_blockers(["r1#0"])
    asyncio.get_running_loop().call_later(0.05, participant.set_blockers, [])
    started = time.monotonic()
    reply = await fence.prepare(prepare())
    assert reply.phase is Phase.PREPARED
    assert time.monotonic() - started < 1.0
    assert participant.calls["wait_changed"] <= 3


async def test_prepare_is_reentrant_while_preparing(
    fence: Fence, participant: FakeParticipant
) -> None:
    participant.set_blockers(["r1#0"])
    first = await fence.prepare(prepare(deadline=soon(0.02)))
    assert first.phase is Phase.PREPARING
    participant.set_blockers([])
    second = await fence.prepare(prepare())
    assert second.phase is Phase.PREPARED
    assert participant.calls["close_admission"] == 1


async def test_restarts_never_block_prepare(fence: Fence, participant: FakeParticipant) -> None:
    participant.restarts = [E("r9#0")]
    reply = await fence.prepare(prepare())
    assert reply.phase is Phase.PREPARED
    assert reply.report.restarts == [E("r9#0")]


async def test_failed_close_admission_reopens_and_does_not_spend_the_id(
    fence: Fence, participant: FakeParticipant
) -> None:
    participant.fail.add("close_admission")
    with pytest.raises(RollpointError, match="close_admission failed"):
        await fence.prepare(prepare())
    assert fence.phase is Phase.IDLE and participant.admission_open
    participant.fail.clear()
    assert (await fence.prepare(prepare())).phase is Phase.PREPARED


async def test_failed_readiness_wait_reopens(fence: Fence, participant: FakeParticipant) -> None:
    participant.set_blockers(["r1#0"])
    participant.fail.add("readiness")
    with pytest.raises(RollpointError, match="readiness"):
        await fence.prepare(prepare())
    assert fence.phase is Phase.IDLE and participant.admission_open


async def test_prepare_after_its_deadline_is_refused(
    fence: Fence, participant: FakeParticipant
) -> None:
    await refused(
        fence, participant, fence.prepare(prepare(deadline=soon(-1))), DeadlineExceededError
    )


async def test_prepare_of_another_id_is_a_conflict(
    fence: Fence, participant: FakeParticipant
) -> None:
    await fence.prepare(prepare("c1"))
    err = await refused(fence, participant, fence.prepare(prepare("c2")), CheckpointConflictError)
    assert "c1" in err.message and err.status == 409


async def test_resume_during_the_wait_makes_prepare_stale(
    fence: Fence, participant: FakeParticipant
) -> None:
    participant.set_blockers(["r1#0"])
    waiting = asyncio.create_task(fence.prepare(prepare(deadline=soon(0.3))))
    await asyncio.sleep(0.02)
    await fence.resume(ResumeRequest(checkpoint_id="c1"))
    with pytest.raises(StaleCheckpointError):
        await waiting
    assert fence.phase is Phase.IDLE and participant.admission_open


# --- resume and stale ids -------------------------------------------------------------------


async def reach(phase: Phase, fence: Fence, participant: FakeParticipant, root: Path) -> str:
    """Bring ``fence`` to ``phase``; return the active checkpoint id."""
    if phase is Phase.RESTORED:
        await committed_snapshot(root)
        await fence.restore(restore("rs1", source="c1"))
        return "rs1"
    participant.set_blockers(["r1#0"] if phase is Phase.PREPARING else [])
    await fence.prepare(prepare(deadline=soon(0.01 if phase is Phase.PREPARING else 5)))
    if phase is Phase.COMMITTED:
        await fence.commit(commit())
    return "c1"


@pytest.mark.parametrize(
    "phase", [Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED, Phase.RESTORED]
)
async def test_resume_reopens_from_every_held_phase(
    fence: Fence, participant: FakeParticipant, root: Path, phase: Phase
) -> None:
    cid = await reach(phase, fence, participant, root)
    assert fence.phase is phase and not participant.admission_open
    reply = await fence.resume(ResumeRequest(checkpoint_id=cid))
    assert reply.phase is Phase.IDLE and not reply.idempotent
    assert fence.phase is Phase.IDLE and participant.admission_open
    assert fence.lease_expires_at is None and fence.checkpoint_id is None
    assert participant.calls["open_admission"] == participant.calls["close_admission"] == 1


async def test_resumed_id_is_stale_and_resume_is_idempotent(
    fence: Fence, participant: FakeParticipant
) -> None:
    await fence.prepare(prepare("c1"))
    await fence.resume(ResumeRequest(checkpoint_id="c1"))
    again = await fence.resume(ResumeRequest(checkpoint_id="c1"))
    assert again.idempotent and again.phase is Phase.IDLE
    await refused(fence, participant, fence.prepare(prepare("c1")), StaleCheckpointError)
    await fence.prepare(prepare("c2"))
    await refused(fence, participant, fence.commit(commit("c1")), StaleCheckpointError)
    await refused(
        fence,
        participant,
        fence.renew(RenewRequest(checkpoint_id="c1", deadline_ts=soon())),
        StaleCheckpointError,
    )


async def test_resume_in_idle_remembers_the_id_so_a_late_prepare_is_stale(
    fence: Fence, participant: FakeParticipant
) -> None:
    reply = await fence.resume(ResumeRequest(checkpoint_id="late"))
    assert reply.idempotent and participant.calls["open_admission"] == 0
    await refused(fence, participant, fence.prepare(prepare("late")), StaleCheckpointError)


async def test_only_the_last_64_resumed_ids_are_remembered(fence: Fence) -> None:
    for i in range(65):
        await fence.resume(ResumeRequest(checkpoint_id=f"old-{i}"))
    with pytest.raises(StaleCheckpointError):
        await fence.prepare(prepare("old-1"))
    assert (await fence.prepare(prepare("old-0"))).phase is Phase.PREPARED


async def test_resume_of_another_active_id_is_a_conflict(
    fence: Fence, participant: FakeParticipant
) -> None:
    await fence.prepare(prepare("c1"))
    await refused(
        fence, participant, fence.resume(ResumeRequest(checkpoint_id="c2")), CheckpointConflictError
    )


# --- commit -----------------------------------------------------------------------------


async def test_commit_writes_the_scope_once_under_the_participant_folder(
    fence: Fence, participant: FakeParticipant, root: Path
) -> None:
    await fence.prepare(prepare())
    reply = await fence.commit(commit(scope=("r2#0", "r1#0", "r1#0")))
    assert reply.phase is Phase.COMMITTED and fence.phase is Phase.COMMITTED
    assert reply.scope_size == 2
    assert (reply.checkpoint_dir, reply.state_dir) == ("snap-1", "agent/agent-replica-0")
    folder = root / "snap-1" / "agent" / "agent-replica-0"
    manifest, records = read_participant_state(
        str(folder), kind="agent", instance="agent-replica-0", checkpoint_id="c1", root=str(root)
    )
    assert manifest == reply.manifest
    assert records == [{"episode": "r1#0", "turns": 3}, {"episode": "r2#0", "turns": 1}]
    assert participant.calls["export"] == 1


async def test_a_scope_named_by_keys_is_the_same_commit_as_by_ids(
    fence: Fence, participant: FakeParticipant, root: Path
) -> None:
    await fence.prepare(prepare())
    # Split across both lists, with a duplicate: the scope is their union.
    by_keys = commit(scope=("r2#0",)).model_copy(update={"episode_keys": ["r1#0", "r2#0"]})
    reply = await fence.commit(by_keys)
    assert reply.scope_size == 2
    _, records = read_participant_state(
        str(state_folder(root)),
        kind="agent",
        instance="agent-replica-0",
        checkpoint_id="c1",
        root=str(root),
    )
    assert records == [{"episode": "r1#0", "turns": 3}, {"episode": "r2#0", "turns": 1}]
    # A retry naming the same set by ids replays it; another set by keys conflicts.
    assert await fence.commit(commit(scope=("r1#0", "r2#0"))) == reply
    other = commit(scope=()).model_copy(update={"episode_keys": ["r1#0"]})
    await refused(fence, participant, fence.commit(other), CheckpointConflictError)
    assert participant.calls["export"] == 1


async def test_commit_replay_returns_the_same_result_and_another_dir_or_scope_conflicts(
    fence: Fence, participant: FakeParticipant
) -> None:
    await fence.prepare(prepare())
    first = await fence.commit(commit())
    assert await fence.commit(commit(scope=("r2#0", "r1#0"))) == first
    await refused(
        fence, participant, fence.commit(commit(directory="other")), CheckpointConflictError
    )
    await refused(
        fence, participant, fence.commit(commit(scope=("r1#0",))), CheckpointConflictError
    )
    assert participant.calls["export"] == 1


async def test_concurrent_commits_export_exactly_once(
    fence: Fence, participant: FakeParticipant
) -> None:
    await fence.prepare(prepare())
    participant.export_gate = asyncio.Event()
    commits = [asyncio.create_task(fence.commit(commit())) for _ in range(5)]
    await asyncio.sleep(0.02)
    participant.export_gate.set()
    replies = await asyncio.gather(*commits)
    assert all(r == replies[0] for r in replies)
    assert participant.calls["export"] == 1 and fence.phase is Phase.COMMITTED


async def test_the_cyclic_gc_is_paused_while_the_participant_is_held_and_back_after(
    fence: Fence, participant: FakeParticipant
) -> None:
    assert gc.isenabled()
    await fence.prepare(prepare())
    assert not gc.isenabled()
    await fence.commit(commit())
    assert not gc.isenabled()
    await fence.resume(ResumeRequest(checkpoint_id="c1"))
    # Not inside the resume: a collection started there would hold its reply.
    assert not gc.isenabled()
    await asyncio.sleep(COLLECTOR_RELEASE_DELAY_S + 0.1)
    assert gc.isenabled()


async def test_a_prepare_right_after_a_resume_keeps_the_collector_held(
    fence: Fence, participant: FakeParticipant
) -> None:
    await fence.prepare(prepare())
    await fence.resume(ResumeRequest(checkpoint_id="c1"))
    await fence.prepare(prepare("c2"))  # before the delayed release fires
    await asyncio.sleep(COLLECTOR_RELEASE_DELAY_S + 0.1)
    assert not gc.isenabled()  # the old release must not free the new hold
    await fence.resume(ResumeRequest(checkpoint_id="c2"))
    await asyncio.sleep(COLLECTOR_RELEASE_DELAY_S + 0.1)
    assert gc.isenabled()


async def test_full_collections_wait_for_the_end_of_a_checkpoints_pause(
    participant: FakeParticipant, root: Path, full_collections: list[int]
) -> None:
    clock = FakeClock(0.0)
    schedule = CollectorSchedule(clock)
    clock.advance(MAX_GAP_S - 1)  # due, not yet overdue
    before = gc.get_threshold()
    with installed(schedule):
        fence = Fence(participant, ControlSettings("t", str(root)))
        try:
            fence.status()  # as the coordinator does first
            assert schedule.attached and gc.get_threshold()[2] > 10**9
            await fence.prepare(prepare())
            await fence.commit(commit())
            await fence.resume(ResumeRequest(checkpoint_id="c1"))
            assert full_collections == []  # none from prepare to resume, though one was due
            await asyncio.sleep(COLLECTOR_RELEASE_DELAY_S + 0.1)
            assert gc.isenabled() and full_collections == [2]
            # The next checkpoint's end comes too soon after: not due again.
            await fence.prepare(prepare("c2"))
            await fence.resume(ResumeRequest(checkpoint_id="c2"))
            await asyncio.sleep(COLLECTOR_RELEASE_DELAY_S + 0.1)
            assert full_collections == [2]
        finally:
            await fence.aclose()
    assert not schedule.attached and gc.get_threshold() == before


async def test_an_overdue_full_collection_runs_in_the_background_but_not_while_held(
    participant: FakeParticipant,
    root: Path,
    full_collections: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(collector_schedule_module, "CHECK_EVERY_S", 0.02)
    clock = FakeClock(0.0)
    schedule = CollectorSchedule(clock)
    with installed(schedule):
        fence = Fence(participant, ControlSettings("t", str(root)))
        try:
            await fence.prepare(prepare())
            clock.advance(MAX_GAP_S)
            await asyncio.sleep(0.2)
            assert full_collections == []  # overdue, but a checkpoint holds the participant
            await fence.resume(ResumeRequest(checkpoint_id="c1"))
            await asyncio.sleep(COLLECTOR_RELEASE_DELAY_S + 0.1)
            assert full_collections == [2]  # run as the pause ended (due as well)
            clock.advance(MAX_GAP_S)
            await asyncio.sleep(0.2)
            assert full_collections == [2, 2]  # no checkpoint: the task ran it
        finally:
            await fence.aclose()
    await asyncio.sleep(0.1)
    clock.advance(MAX_GAP_S)
    await asyncio.sleep(0.1)
    assert len(full_collections) == 2  # the task stopped with the fence


async def test_fences_attach_on_first_use_and_the_last_close_detaches(
    participant: FakeParticipant, root: Path, full_collections: list[int]
) -> None:
    schedule = CollectorSchedule()
    before = gc.get_threshold()
    with installed(schedule):
        fences = [Fence(participant, ControlSettings("t", str(root))) for _ in "ab"]
        assert not schedule.attached  # an app factory's loop may not be the one serving it
        fences[0].status()
        await fences[1].prepare(prepare())
        assert schedule.attached and gc.get_threshold()[2] > 10**9
        await fences[0].aclose()
        await fences[0].aclose()  # idempotent: detaches once
        assert schedule.attached and gc.get_threshold()[2] > 10**9
        await fences[1].aclose()
        assert not schedule.attached and gc.get_threshold() == before
        fences[0].status()  # a closed fence does not attach again
        assert not schedule.attached


async def test_a_write_outliving_the_deadline_fails_the_call_and_a_retry_collects_it(
    fence: Fence, participant: FakeParticipant
) -> None:
    await fence.prepare(prepare())
    participant.export_gate = asyncio.Event()
    hurried = commit().model_copy(update={"deadline_ts": soon(0.05)})
    with pytest.raises(DeadlineExceededError, match="outlived the deadline"):
        await fence.commit(hurried)
    assert fence.phase is Phase.PREPARED
    participant.export_gate.set()
    reply = await fence.commit(commit())
    assert reply.phase is Phase.COMMITTED and participant.calls["export"] == 1


async def test_commit_outside_prepared_is_an_invalid_phase(
    fence: Fence, participant: FakeParticipant
) -> None:
    await refused(fence, participant, fence.commit(commit()), InvalidPhaseError)
    participant.set_blockers(["r1#0"])
    await fence.prepare(prepare(deadline=soon(0.01)))
    await refused(fence, participant, fence.commit(commit()), InvalidPhaseError)


async def test_commit_refuses_a_readiness_regression_naming_blockers(
    fence: Fence, participant: FakeParticipant
) -> None:
    await fence.prepare(prepare())
    participant.set_blockers(["r7#0"])
    err = await refused(fence, participant, fence.commit(commit()), InvalidPhaseError)
    assert "r7#0" in err.message and participant.calls["export"] == 0


async def test_commit_refuses_a_scope_naming_a_reported_restart(
    fence: Fence, participant: FakeParticipant
) -> None:
    participant.restarts = [E("r2#0")]
    await fence.prepare(prepare())
    err = await refused(fence, participant, fence.commit(commit()), InvalidCheckpointStateError)
    assert "r2#0" in err.message and err.status == 422


async def test_commit_after_its_deadline_is_refused(
    fence: Fence, participant: FakeParticipant
) -> None:
    await fence.prepare(prepare())
    late = commit().model_copy(update={"deadline_ts": soon(-1)})
    await refused(fence, participant, fence.commit(late), DeadlineExceededError)


async def test_failed_export_can_be_retried(fence: Fence, participant: FakeParticipant) -> None:
    await fence.prepare(prepare())
    participant.fail.add("export")
    with pytest.raises(SnapshotError, match="export failed"):
        await fence.commit(commit())
    assert fence.phase is Phase.PREPARED
    participant.fail.clear()
    assert (await fence.commit(commit())).phase is Phase.COMMITTED


def block_state_folder(root: Path) -> Path:
    """Put a file where the participant's state folder goes, so its write fails."""
    blocker = root / "snap-1" / "agent"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("a file where the participant folder should be")
    return blocker


async def test_failed_write_is_retried_without_exporting_again(
    fence: Fence, participant: FakeParticipant, root: Path
) -> None:
    await fence.prepare(prepare())
    blocker = block_state_folder(root)
    with pytest.raises(RollpointError):
        await fence.commit(commit())
    assert fence.phase is Phase.PREPARED
    blocker.unlink()
    assert (await fence.commit(commit())).phase is Phase.COMMITTED
    assert participant.calls["export"] == 1


# --- detached writes -----------------------------------------------------------------


def detached(cid: str = "c1", directory: str = "snap-1") -> CommitRequest:
    return commit(cid, directory).model_copy(update={"wait_for_write": False})


def confirm(cid: str = "c1", deadline: float | None = None) -> ConfirmRequest:
    return ConfirmRequest(checkpoint_id=cid, deadline_ts=deadline or soon())


STATE_IN_STAGING = "staging/s1/agent/agent-replica-0"


def state_folder(root: Path, directory: str = "snap-1") -> Path:
    return root / directory / "agent" / "agent-replica-0"


async def test_a_detached_commit_replies_before_the_write_and_confirm_returns_what_it_captured(
    fence: Fence, participant: FakeParticipant, root: Path
) -> None:
    await fence.prepare(prepare())
    reply = await fence.commit(detached())
    assert reply.phase is Phase.COMMITTED and reply.manifest is None
    assert reply.scope_size == 2
    assert reply.exported is None  # scanned with the write, after the pause
    await fence.resume(ResumeRequest(checkpoint_id="c1"))
    # Nothing is written until confirm asks: an aborted checkpoint writes nothing.
    assert not state_folder(root).exists()
    assert participant.admission_open and fence.phase is Phase.IDLE
    participant.state["r1#0"] = 9  # the sessions moved on after the cut
    confirmed = await fence.confirm(confirm())
    manifest, records = read_participant_state(
        str(state_folder(root)),
        kind="agent",
        instance="agent-replica-0",
        checkpoint_id="c1",
        root=str(root),
    )
    assert confirmed.manifest == manifest and confirmed.checkpoint_id == "c1"
    assert records == [{"episode": "r1#0", "turns": 3}, {"episode": "r2#0", "turns": 1}]
    assert await fence.confirm(confirm()) == confirmed
    assert participant.calls["export"] == 1


async def test_confirm_names_an_unknown_checkpoint_as_not_found(
    fence: Fence, participant: FakeParticipant
) -> None:
    err = await refused(fence, participant, fence.confirm(confirm("never")), NotFoundError)
    assert err.status == 404 and "never" in err.message
    await fence.prepare(prepare())
    # Prepared but not committed: there is nothing to confirm yet.
    await refused(fence, participant, fence.confirm(confirm()), NotFoundError)


async def test_a_failed_detached_write_fails_confirm_and_the_next_confirm_writes_it(
    fence: Fence, participant: FakeParticipant, root: Path
) -> None:
    await fence.prepare(prepare())
    blocker = block_state_folder(root)
    await fence.commit(detached())
    await fence.resume(ResumeRequest(checkpoint_id="c1"))
    with pytest.raises(RollpointError, match="agent-replica-0"):
        await fence.confirm(confirm())
    blocker.unlink()
    confirmed = await fence.confirm(confirm())
    assert confirmed.manifest.count == 2 and participant.calls["export"] == 1


def everything_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("swapped", ["staging/s1", "staging/s1/agent", STATE_IN_STAGING])
async def test_a_symlink_swap_in_the_staging_folder_after_commit_and_before_confirm_is_refused(
    fence: Fence, participant: FakeParticipant, root: Path, tmp_path: Path, swapped: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "staging" / "s1").mkdir(parents=True)
    await fence.prepare(prepare())
    await fence.commit(detached(directory="staging/s1"))
    await fence.resume(ResumeRequest(checkpoint_id="c1"))
    # Checked when the commit named it; swapped for a symlink out of the store after.
    target = root / swapped
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        target.rmdir()
    target.symlink_to(outside, target_is_directory=True)

    with pytest.raises(BadRequestError, match=rf"symlink at '{target.name}' inside the store"):
        await fence.confirm(confirm())
    assert everything_under(outside) == []
    # The store put right, the same confirm writes the capture where it belongs.
    target.unlink()
    confirmed = await fence.confirm(confirm())
    manifest, _ = read_participant_state(
        str(root / STATE_IN_STAGING),
        kind="agent",
        instance="agent-replica-0",
        checkpoint_id="c1",
        root=str(root),
    )
    assert confirmed.manifest == manifest and participant.calls["export"] == 1


async def test_a_restore_never_reads_a_records_file_through_a_symlink(
    fence: Fence, participant: FakeParticipant, root: Path, tmp_path: Path
) -> None:
    await committed_snapshot(root)
    (records,) = records_paths(state_folder(root), root)
    copy = tmp_path / "outside.jsonl"
    copy.write_bytes(records.read_bytes())
    records.unlink()
    records.symlink_to(copy)  # the same bytes, from outside the store

    err = await refused(fence, participant, fence.restore(restore(source="c1")), BadRequestError)
    assert "symlink" in err.message and records.name in err.message
    assert participant.calls["install"] == 0


@pytest.fixture
def release(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """State writes wait (in their worker thread) until the returned event is set."""
    gate = threading.Event()
    real_write = checkpoint_write_module.write_participant_state

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        gate.wait(5)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(checkpoint_write_module, "write_participant_state", slow_write)
    return gate


async def test_a_confirm_outliving_its_deadline_fails_and_the_write_goes_on(
    fence: Fence, participant: FakeParticipant, release: threading.Event
) -> None:
    await fence.prepare(prepare())
    await fence.commit(detached())
    await fence.resume(ResumeRequest(checkpoint_id="c1"))
    with pytest.raises(DeadlineExceededError, match="write outlived the deadline"):
        await fence.confirm(confirm(deadline=soon(0.05)))
    release.set()
    assert (await fence.confirm(confirm())).manifest.count == 2


async def test_a_new_capture_waits_for_the_earlier_checkpoints_write(
    fence: Fence, participant: FakeParticipant, release: threading.Event
) -> None:
    await fence.prepare(prepare())
    await fence.commit(detached())
    await fence.resume(ResumeRequest(checkpoint_id="c1"))
    first_write = asyncio.create_task(fence.confirm(confirm()))
    await fence.prepare(prepare("c2"))
    second = asyncio.create_task(fence.commit(detached("c2", "snap-2")))
    await asyncio.sleep(0.1)
    # At most one checkpoint's captured records wait in memory for their write.
    assert not second.done() and not first_write.done() and participant.calls["export"] == 1
    release.set()
    assert (await second).phase is Phase.COMMITTED
    assert participant.calls["export"] == 2
    assert (await first_write).manifest.checkpoint_id == "c1"


async def test_a_new_capture_drops_an_earlier_one_nobody_confirmed(
    fence: Fence, participant: FakeParticipant, root: Path
) -> None:
    await fence.prepare(prepare())
    await fence.commit(detached())
    await fence.resume(ResumeRequest(checkpoint_id="c1"))  # aborted: no confirm comes
    await fence.prepare(prepare("c2"))
    await fence.commit(detached("c2", "snap-2"))
    await refused(fence, participant, fence.confirm(confirm("c1")), NotFoundError)
    assert not state_folder(root).exists()
    assert (await fence.confirm(confirm("c2"))).manifest.checkpoint_id == "c2"


async def test_a_commit_that_waits_for_its_write_carries_the_manifest_confirm_returns(
    fence: Fence, participant: FakeParticipant
) -> None:
    await fence.prepare(prepare())
    reply = await fence.commit(commit())
    assert reply.manifest is not None and reply.exported is not None
    confirmed = await fence.confirm(confirm())
    assert (confirmed.manifest, confirmed.exported) == (reply.manifest, reply.exported)


@pytest.mark.parametrize("bad", ["../escape", "/abs/dir", "a/../../b", "a\\b", "."])
async def test_commit_refuses_paths_outside_the_root(
    fence: Fence, participant: FakeParticipant, bad: str
) -> None:
    await fence.prepare(prepare())
    err = await refused(fence, participant, fence.commit(commit(directory=bad)), BadRequestError)
    assert err.status == 400 and repr(bad)[1:-1] in err.message


@pytest.fixture
def escaping_link(root: Path, tmp_path: Path) -> str:
    root.mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    return "link"


async def test_commit_refuses_a_symlink_out_of_the_root(
    fence: Fence, participant: FakeParticipant, escaping_link: str
) -> None:
    await fence.prepare(prepare())
    await refused(
        fence, participant, fence.commit(commit(directory=escaping_link)), BadRequestError
    )


# --- restore ----------------------------------------------------------------------------


async def committed_snapshot(root: Path) -> None:
    """Commit c1 into snap-1 from another participant of the same identity."""
    source = FakeParticipant()
    source.state = {"r1#0": 3, "r2#0": 1}
    fence = Fence(source, ControlSettings(token="t", snapshot_root=str(root)))
    await fence.prepare(prepare())
    await fence.commit(commit())
    await fence.resume(ResumeRequest(checkpoint_id="c1"))
    await fence.aclose()


async def test_restore_installs_all_and_waits_closed_until_resume(
    fence: Fence, participant: FakeParticipant, root: Path
) -> None:
    await committed_snapshot(root)
    reply = await fence.restore(restore("rs1", source="c1"))
    assert reply.phase is Phase.RESTORED and fence.phase is Phase.RESTORED
    assert reply.restored == [E("r1#1"), E("r2#1")]
    assert reply.source_checkpoint_id == "c1"
    assert participant.state == {"r1#1": 3, "r2#1": 1}
    with pytest.raises(StaleAttemptError):
        fence.check_attempt(E("r1#0"))
    fence.check_attempt(E("r1#1"))
    assert not participant.admission_open and fence.lease_expires_at is not None
    assert await fence.restore(restore("rs1", source="c1")) == reply
    await refused(
        fence,
        participant,
        fence.restore(restore("rs1", scope=("r1#0",), source="c1")),
        CheckpointConflictError,
    )
    await fence.resume(ResumeRequest(checkpoint_id="rs1"))
    assert fence.phase is Phase.IDLE and participant.admission_open
    assert participant.calls["install"] == 1


async def test_a_restore_decodes_its_state_with_the_collector_paused(
    participant: FakeParticipant, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await committed_snapshot(root)
    seen: list[bool] = []
    real_read = state_folders_module.read_participant_state

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return real_read(*args, **kwargs)

    monkeypatch.setattr(state_folders_module, "read_participant_state", spy)
    # Nothing on the seam: the decode pause is the reader's own, not a listener's.
    with seam.listening(seam.CheckpointListener()):
        fence = Fence(participant, ControlSettings("t", str(root)))
        try:
            await fence.restore(restore(source="c1"))
        finally:
            await fence.aclose()
    assert seen == [False] and gc.isenabled()


async def test_failed_install_leaves_the_participant_idle_and_unchanged(
    fence: Fence, participant: FakeParticipant, root: Path
) -> None:
    await committed_snapshot(root)
    participant.fail.add("install")
    with pytest.raises(RestoreError, match="install failed"):
        await fence.restore(restore(source="c1"))
    assert fence.phase is Phase.IDLE and fence.checkpoint_id is None
    assert participant.admission_open and participant.state == {"r1#0": 3, "r2#0": 1}
    assert fence.retire_marks == {}
    participant.fail.clear()
    assert (await fence.restore(restore(source="c1"))).phase is Phase.RESTORED


@pytest.mark.parametrize(
    ("directory", "source"), [("missing", "c1"), ("snap-1", "other-checkpoint")]
)
async def test_restore_refuses_missing_or_foreign_state_before_touching_anything(
    fence: Fence, participant: FakeParticipant, root: Path, directory: str, source: str
) -> None:
    await committed_snapshot(root)
    await refused(
        fence,
        participant,
        fence.restore(restore(directory=directory, source=source)),
        InvalidCheckpointStateError,
    )
    assert participant.calls["close_admission"] == 0


async def test_restore_refused_outside_idle(fence: Fence, participant: FakeParticipant) -> None:
    await fence.prepare(prepare())
    await refused(fence, participant, fence.restore(restore("c1")), InvalidPhaseError)


# --- lease ------------------------------------------------------------------------------


async def test_lease_lapse_reopens_within_a_second_and_logs(
    participant: FakeParticipant, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fence = Fence(participant, ControlSettings("t", str(root), lease_grace_s=0.1))
    try:
        await fence.prepare(prepare(deadline=soon(0.1)))
        assert fence.phase is Phase.PREPARED
        with caplog.at_level(logging.WARNING, logger="rollpoint.participant.fence"):
            for _ in range(100):
                if fence.phase is Phase.IDLE:
                    break
                await asyncio.sleep(0.02)
        assert fence.phase is Phase.IDLE and participant.admission_open
        await asyncio.sleep(COLLECTOR_RELEASE_DELAY_S + 0.1)
        assert gc.isenabled()  # held while prepared; the lapse lets it run again
        assert any(
            "lease expired; reopening" in r.getMessage() and "c1" in r.getMessage()
            for r in caplog.records
        )
        with pytest.raises(StaleCheckpointError):
            await fence.commit(commit())
    finally:
        await fence.aclose()


async def test_renew_keeps_the_lease_alive(participant: FakeParticipant, root: Path) -> None:
    fence = Fence(participant, ControlSettings("t", str(root), lease_grace_s=0.2))
    try:
        first = await fence.prepare(prepare(deadline=soon(0.1)))
        while time.time() < first.lease_expires_at + 0.2:
            reply = await fence.renew(RenewRequest(checkpoint_id="c1", deadline_ts=soon(0.1)))
            assert reply.lease_expires_at == fence.lease_expires_at
            await asyncio.sleep(0.05)
        assert fence.phase is Phase.PREPARED and not participant.admission_open
    finally:
        await fence.aclose()


async def test_renew_refused_in_idle_and_for_another_id(
    fence: Fence, participant: FakeParticipant
) -> None:
    renew = RenewRequest(checkpoint_id="c1", deadline_ts=soon())
    await refused(fence, participant, fence.renew(renew), InvalidPhaseError)
    await fence.prepare(prepare("c2"))
    await refused(fence, participant, fence.renew(renew), CheckpointConflictError)


# --- retire, forget, ack ----------------------------------------------------------------


async def test_retire_marks_refuse_old_attempts_until_forgotten(
    fence: Fence, participant: FakeParticipant
) -> None:
    participant.running = [E("r1#2")]
    reply = await fence.retire(RetireRequest(episode_ids=[E("r1#1"), E("r1#2")]))
    assert reply.marks == {"r1": 2}
    assert [(o.episode, o.outcome) for o in reply.outcomes] == [
        (E("r1#2"), RetireOutcomeKind.CANCELLED)
    ]
    for attempt in (0, 1, 2):
        with pytest.raises(StaleAttemptError):
            fence.check_attempt(EpisodeId(rollout_id="r1", attempt=attempt))
    fence.check_attempt(E("r1#3"))
    fence.check_attempt(E("r2#0"))
    lower = await fence.retire(RetireRequest(episode_ids=[E("r1#0")]))
    assert lower.marks == {"r1": 2}, "marks only rise"
    assert fence.status().retired_rollouts == 1
    assert (await fence.forget(ForgetRequest(rollout_ids=["r1", "r9"]))).forgotten == ["r1"]
    fence.check_attempt(E("r1#0"))
    assert fence.status().retired_rollouts == 0


async def test_retire_marks_stay_raised_when_the_hook_fails(
    fence: Fence, participant: FakeParticipant
) -> None:
    participant.fail.add("retire")
    with pytest.raises(RollpointError, match="retire failed"):
        await fence.retire(RetireRequest(episode_ids=[E("r1#0")]))
    with pytest.raises(StaleAttemptError):
        fence.check_attempt(E("r1#0"))


async def test_retire_and_forget_refused_while_a_checkpoint_is_open(
    fence: Fence, participant: FakeParticipant
) -> None:
    await fence.prepare(prepare())
    await refused(
        fence, participant, fence.retire(RetireRequest(episode_ids=[E("r1#0")])), InvalidPhaseError
    )
    await refused(
        fence, participant, fence.forget(ForgetRequest(rollout_ids=["r1"])), InvalidPhaseError
    )


async def test_retire_allowed_while_restored(
    fence: Fence, participant: FakeParticipant, root: Path
) -> None:
    await committed_snapshot(root)
    await fence.restore(restore("rs", source="c1"))
    reply = await fence.retire(RetireRequest(episode_ids=[E("r1#1")]))
    assert reply.marks == {"r1": 1} and fence.phase is Phase.RESTORED


async def test_ack_releases_finished_replies_in_any_phase(
    fence: Fence, participant: FakeParticipant
) -> None:
    participant.finished_unacked = [E("r5#0"), E("r6#0")]
    await fence.prepare(prepare())
    reply = await fence.ack(AckRequest(episode_ids=[E("r5#0"), E("r7#0")]))
    assert reply.acked == [E("r5#0")]
    assert participant.finished_unacked == [E("r6#0")]
    assert (await fence.ack(AckRequest(episode_ids=[E("r5#0")]))).acked == []


async def test_status_reports_identity_and_counts(
    fence: Fence, participant: FakeParticipant
) -> None:
    status = fence.status()
    assert status.kind.value == "agent" and status.name == "agent"
    assert status.replica == "replica-0" and status.mode.value == "turn"
    assert status.protocol_version == 1
    assert status.features == ["turn-boundary", "detached-write", "scope-keys"]
    assert status.phase is Phase.IDLE and status.checkpoint_id is None
    assert status.lease_expires_at is None
    assert status.counts == {"sessions": 2, "finished_unacked": 0, "admission_closes": 0}
    assert status.retired_rollouts == 0


# --- capturing participants: a copy in the pause, records built by the writer ---------------
class CapturingFake(FakeParticipant):
    """Copies its state in ``capture`` and builds the records when the writer asks."""

    def __init__(self) -> None:
        super().__init__()
        self.kept_current = 0
        self.closed = False
        self.built_on: list[str] = []

    def keep_current(self) -> None:
        self.kept_current += 1

    async def capture(self, scope: Any) -> Any:
        self._hook("capture")
        copy = dict(self.state)

        def build() -> list[dict[str, Any]]:
            self.built_on.append(threading.current_thread().name)
            return [{"episode": e.key, "turns": copy.get(e.key, 0)} for e in scope]

        return build

    async def aclose(self) -> None:
        self.closed = True


async def test_a_capturing_participant_is_copied_in_the_pause_and_built_after_it(
    root: Path,
) -> None:
    participant = CapturingFake()
    participant.state = {"r1#0": 3, "r2#0": 1}
    fence = Fence(participant, ControlSettings(token="t", snapshot_root=str(root)))
    fence.status()
    fence.status()
    assert participant.kept_current == 1  # told once, at the first status
    await fence.prepare(prepare())
    detached = commit().model_copy(update={"wait_for_write": False})
    reply = await fence.commit(detached)
    assert reply.manifest is None and participant.built_on == []  # nothing built in the pause
    assert participant.calls["capture"] == 1 and participant.calls["export"] == 0
    await fence.resume(ResumeRequest(checkpoint_id="c1"))
    participant.state["r1#0"] = 9  # the sessions moved on after the cut
    confirmed = await fence.confirm(confirm())
    assert confirmed.manifest is not None
    assert participant.built_on and participant.built_on[0] != threading.current_thread().name
    _, records = read_participant_state(
        str(state_folder(root)),
        kind="agent",
        instance="agent-replica-0",
        checkpoint_id="c1",
        root=str(root),
    )
    assert records == [{"episode": "r1#0", "turns": 3}, {"episode": "r2#0", "turns": 1}]
    await fence.aclose()
    assert participant.closed


class JournalingFake(FakeParticipant):
    """A participant whose journal moves on as the test says (a position per call)."""

    def __init__(self) -> None:
        super().__init__()
        self.position = 100

    def journal_mark(self) -> JournalMark:
        self._hook("journal_mark")
        return JournalMark(folder="journal/agent/agent-replica-0", segment=2, offset=self.position)


async def test_a_commit_saves_the_journal_position_the_cut_opened_at(root: Path) -> None:
    participant = JournalingFake()
    participant.state = {"r1#0": 3}
    with installed():
        fence = Fence(participant, ControlSettings(token="t", snapshot_root=str(root)))
        try:
            await fence.prepare(prepare())
            participant.position = 900  # a call journaled while the cut is open
            reply = await fence.commit(commit(scope=("r1#0",)))
            assert reply.manifest is not None and reply.manifest.journal is not None
            assert reply.manifest.journal.offset == 100
            await fence.resume(ResumeRequest(checkpoint_id="c1"))
            # The next cut asks again; a participant without the hook saves no mark.
            await fence.prepare(prepare("c2"))
            again = await fence.commit(commit("c2", "snap-2", scope=("r1#0",)))
            assert again.manifest is not None and again.manifest.journal is not None
            assert again.manifest.journal.offset == 900
            assert participant.calls["journal_mark"] == 2
        finally:
            await fence.aclose()


async def test_a_participant_that_does_not_journal_saves_no_mark(
    fence: Fence, participant: FakeParticipant
) -> None:
    await fence.prepare(prepare())
    reply = await fence.commit(commit())
    assert reply.manifest is not None and reply.manifest.journal is None
