"""Pause-free saves (``snapshot.mode: journal``) over in-process fences (no sockets).

Each participant of the rig journals (a position it advances as the test says); the
coordinator's journal path must close no admission and park nothing, publish a manifest
listing every try in flight as ``journaled`` with each participant's floor as its mark, and
fall back to the cut for a participant that does not journal. The restore side: the
restorer sends each journaled try again under its own identity, pinned to its replica.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from rollpoint.app.snapshot_report import build_report
from rollpoint.protocol.control import JOURNAL, CheckpointRequest, Phase
from rollpoint.protocol.errors import BadRequestError, CheckpointConflictError
from rollpoint.protocol.manifest import JournalMark, decode_document, load_participant_manifest
from rollpoint.store.snapshot_store import SNAPSHOTS_DIR
from rollpoint.trainer.record.workdir_record import WorkdirRecord
from rollpoint.trainer.restore.restorer import Restorer
from rollpoint.trainer.snapshot.coordinator import SnapshotCoordinator
from rollpoint.trainer.snapshot.journal_floors import JournalFloors
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_record import RolloutState
from tests.unit.trainer.in_process_rig import TASK, Rig, SessionParticipant, build_rig


class JournalingSessions(SessionParticipant):
    """The rig's participant with a journal: its position is the test's to move."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.features = (*self.features, JOURNAL)
        self.segment = 3
        self.offset = 100
        self.marks_taken = 0

    def journal_mark(self) -> JournalMark:
        self._hook("journal_mark")
        self.marks_taken += 1
        return JournalMark(
            folder=f"journal/{self.kind.value}/{self.name}-{self.replica}",
            segment=self.segment,
            offset=self.offset,
        )


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = build_rig(tmp_path / "snapshots", participant=JournalingSessions)
    yield r
    await r.aclose()


def journal_mode(coordinator: SnapshotCoordinator) -> SnapshotCoordinator:
    coordinator.config = replace(coordinator.config, mode="journal")
    return coordinator


def participant_marks(rig: Rig, snapshot_id: str) -> dict[str, JournalMark | None]:
    manifest = rig.store.verify(snapshot_id)
    folder = rig.root / SNAPSHOTS_DIR / snapshot_id
    marks = {}
    for p in manifest.participants:
        doc = decode_document((folder / p.manifest_path).read_bytes(), p.instance)
        marks[f"{p.kind}@{p.replica}"] = load_participant_manifest(doc, p.instance).journal
    return marks


async def test_a_journal_save_closes_no_admission_and_lists_every_try_in_flight(rig: Rig) -> None:
    episodes = rig.dispatch()
    coordinator = journal_mode(rig.coordinator())
    report = await coordinator.save()
    assert report.published, report.blocked_by
    assert report.pause_s == 0.0
    assert (report.saved, report.journaled, coordinator.published_with_episodes) == (0, 2, 1)
    for label, participant in rig.participants.items():
        # No prepare, no commit, no admission move: only the checkpoint verb reached it.
        assert "close_admission" not in participant.calls, label
        assert participant.admission_open, label
        assert rig.calls(label) == ["status", "checkpoint"], label
    assert rig.barrier.is_open
    assert set(rig.phases().values()) == {Phase.IDLE}
    manifest = rig.store.verify(report.snapshot_id)
    assert manifest.pause_seconds == 0.0
    assert (manifest.episodes, manifest.restarts, manifest.finished) == ([], [], [])
    assert sorted(f"{j.rollout_id}#{j.attempt}" for j in manifest.journaled) == sorted(
        e.key for e in episodes
    )
    shown = build_report(str(rig.root))  # what `rollpoint inspect` shows
    assert len(shown["latest"]["journaled"]) == len(episodes)
    assert shown["snapshots"][0]["journaled"] == len(episodes)
    # The first save of a coordinator cannot bound its floor: every journal is kept whole.
    assert {
        m.segment if m else None for m in participant_marks(rig, report.snapshot_id).values()
    } == {1}


async def test_a_journal_save_names_the_position_from_before_the_oldest_try_in_flight(
    rig: Rig,
) -> None:
    coordinator = journal_mode(rig.coordinator())
    first = await coordinator.save()  # nothing in flight: its positions bound the next
    assert first.published, first.blocked_by
    for participant in rig.participants.values():
        participant.segment, participant.offset = 5, 0
    rig.dispatch()  # after the first save's replies: records of it come after segment 3
    second = await coordinator.save()
    assert second.published, second.blocked_by
    marks = participant_marks(rig, second.snapshot_id)
    assert {(m.segment, m.offset) for m in marks.values() if m} == {(3, 100)}
    # While that try lives, later saves keep naming the first save's positions.
    for participant in rig.participants.values():
        participant.segment = 9
    third = await coordinator.save()
    assert {
        (m.segment, m.offset) for m in participant_marks(rig, third.snapshot_id).values() if m
    } == {(3, 100)}
    # Once it is sealed, the floor moves up to a save taken after it began.
    for record in rig.ledger.in_flight():
        rig.ledger.finish(record.rollout_id)
        rig.ledger.seal(record.rollout_id)
    fourth = await coordinator.save()
    assert {
        (m.segment, m.offset) for m in participant_marks(rig, fourth.snapshot_id).values() if m
    } == {(9, 0)}


async def test_a_participant_that_does_not_journal_makes_the_save_take_the_cut(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.dispatch()
    resources = rig.participants["resources@replica-0"]
    resources.features = tuple(f for f in resources.features if f != JOURNAL)
    report = await journal_mode(rig.coordinator()).save()
    assert report.published, report.blocked_by
    assert "prepare" in rig.calls("model@replica-0")
    assert rig.store.verify(report.snapshot_id).journaled == []
    assert "resources@replica-0 do(es) not journal" in caplog.text


async def test_a_final_save_takes_the_cut_in_journal_mode(rig: Rig) -> None:
    rig.dispatch()
    coordinator = journal_mode(rig.coordinator())
    report = await coordinator.save(final=True)
    assert report.published, report.blocked_by
    assert "prepare" in rig.calls("agent@replica-0")
    assert rig.store.verify(report.snapshot_id).journaled == []


async def test_a_participant_failing_its_checkpoint_fails_the_save_and_publishes_nothing(
    rig: Rig,
) -> None:
    rig.dispatch()
    rig.participants["agent@replica-0"].fail.add("journal_mark")
    report = await journal_mode(rig.coordinator()).save()
    assert not report.published
    assert [b.participant for b in report.blockers] == ["agent@replica-0"]
    assert [b.verb for b in report.blockers] == ["checkpoint"]
    assert rig.store.list_snapshots() == []
    assert all(p.admission_open for p in rig.participants.values())


async def test_the_fence_refuses_a_checkpoint_while_a_cut_holds_it_and_a_floor_past_now(
    rig: Rig,
) -> None:
    fence = rig.fences["model@replica-0"]
    await rig.client("model@replica-0").prepare("cut-1", time.time() + 30)
    request = CheckpointRequest(
        checkpoint_id="j-1", deadline_ts=time.time() + 30, checkpoint_dir="x/p"
    )
    with pytest.raises(CheckpointConflictError, match="checkpoint cut-1 is active"):
        await fence.checkpoint(request)
    await rig.client("model@replica-0").resume("cut-1")
    past = JournalMark(folder="journal/model/model-replica-0", segment=4, offset=0)
    with pytest.raises(BadRequestError, match="past the journal's position 3:100"):
        await fence.checkpoint(request.model_copy(update={"floor": past}))
    other = JournalMark(folder="journal/agent/agent-replica-0", segment=1, offset=0)
    with pytest.raises(BadRequestError, match="floor names journal"):
        await fence.checkpoint(request.model_copy(update={"floor": other}))
    reply = await fence.checkpoint(request)
    again = await fence.checkpoint(request)
    assert again == reply  # a retry of the same id returns the recorded reply
    # The cut's prepare took one, each refused floor one (it is checked against the mark)
    # and the checkpoint one; the retry takes none.
    assert rig.participants["model@replica-0"].marks_taken == 4


async def test_a_restore_sends_each_journaled_try_again_under_its_own_identity(
    rig: Rig, tmp_path: Path
) -> None:
    episodes = rig.dispatch()
    report = await journal_mode(rig.coordinator()).save()
    assert report.published, report.blocked_by
    point = rig.resume_point(report.snapshot_id)
    run = await Restorer(rig.clients).restore(point, step_record=WorkdirRecord(tmp_path))
    assert run.resent == len(episodes)
    assert (run.restarted, run.adopted, run.continued) == (0, 0, [])
    for e in episodes:
        record = run.ledger.get(e.rollout_id)
        assert (record.state, record.attempt, record.replica) == (
            RolloutState.QUEUED,
            e.attempt,
            "replica-0",
        )


def test_floors_give_no_bound_for_a_try_live_at_the_first_scan() -> None:
    now = [0.0]
    floors = JournalFloors(clock=lambda: now[0])
    ledger = RecoveryLedger()
    (record,) = ledger.add_group(TASK, "g0", 1)
    ledger.dispatch(record.rollout_id, "replica-0")
    mark = JournalMark(folder="journal/model/model-replica-0", segment=2, offset=0)
    assert floors.floors(ledger.live_records()) == {}
    floors.reported({"model@replica-0": mark})
    now[0] = 10.0
    assert floors.floors(ledger.live_records()) == {}  # it may have journaled earlier
    ledger.finish(record.rollout_id)
    ledger.seal(record.rollout_id)
    now[0] = 20.0
    assert floors.floors(ledger.live_records()) == {"model@replica-0": mark}
    assert floors.tracked == 0
