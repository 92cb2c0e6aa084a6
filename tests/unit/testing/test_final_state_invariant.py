"""I2 counted from the environment's own final state (the resources servers' final-state
log), with the real workplace environment's SQLite databases."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollpoint.envs.workplace import WorkplaceEnvironment
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.resources.final_state_log import FinalStateLog
from rollpoint.testing import invariants
from rollpoint.testing.invariants import Invariant, TrainedRollout

ENV = WorkplaceEnvironment()
TASK = TaskRow(
    task_id="workplace-0000",
    environment="workplace",
    prompt="p",
    params={
        "events": [
            {
                "title": "Team sync",
                "date": "2025-01-15",
                "start_time": "10:00",
                "duration_minutes": 30,
            }
        ],
        "emails": [{"to": "ana@example.com", "subject": "Team sync scheduled"}],
    },
)
EVENT = {"title": "Team sync", "date": "2025-01-15", "start_time": "10:00", "duration_minutes": 30}
EMAIL = {"to": "ana@example.com", "subject": "Team sync scheduled", "body": "See you."}


def final_state(*, emails: int = 1, events: int = 1) -> dict[str, Any]:
    """The exported database of an episode that sent the email ``emails`` times."""
    state = ENV.start(TASK)
    for _ in range(events):
        ENV.call(state, "calendar_create_event", EVENT)
    for _ in range(emails):
        ENV.call(state, "email_send", EMAIL)
    try:
        return ENV.export_state(state)
    finally:
        ENV.close(state)


def trained(rollout_id: str, attempt: int = 1) -> TrainedRollout:
    return TrainedRollout(
        line=1,
        task_id=TASK.task_id,
        group_id="workplace-0000-g0",
        row=0,
        rollout_id=rollout_id,
        attempt=attempt,
        reward=1.0,  # what the transcript and reward say is not what I2 reads
        turns=3,
        messages=[],
        model_calls=None,
    )


def log(
    folder: Path, *entries: tuple[str, int, dict[str, Any]], replica: str = "replica-0"
) -> None:
    journal = FinalStateLog(folder, replica)
    for rollout_id, attempt, state in entries:
        journal.append(
            EpisodeId(rollout_id=rollout_id, attempt=attempt), TASK.task_id, "workplace", state
        )
    journal.close()


def check(folder: Path, *rollouts: TrainedRollout) -> list[invariants.Violation]:
    return invariants.check_side_effects_from_state(
        list(rollouts), [TASK], folder, full_reward="continued"
    )


def test_every_effect_once_in_the_final_state_holds(tmp_path: Path) -> None:
    log(tmp_path, ("r1", 1, final_state()))
    assert check(tmp_path, trained("r1")) == []


def test_an_email_the_final_state_holds_twice_is_a_violation_whatever_the_reward(
    tmp_path: Path,
) -> None:
    log(tmp_path, ("r1", 1, final_state(emails=2)))
    found = check(tmp_path, trained("r1"))
    assert [(v.kind, v.detail) for v in found] == [
        (
            Invariant.SIDE_EFFECTS_ONCE,
            "applied 2 times: email to ana@example.com subject 'Team sync scheduled'",
        )
    ]


def test_the_last_line_of_the_trained_attempt_is_the_one_read(tmp_path: Path) -> None:
    # An earlier verify of the same attempt (nothing applied yet), then the final one; and
    # another attempt of the rollout whose state is not the trained one.
    log(
        tmp_path,
        ("r1", 1, final_state(emails=0, events=0)),
        ("r1", 0, final_state(emails=2)),
        ("r1", 1, final_state()),
    )
    assert check(tmp_path, trained("r1")) == []


def test_of_one_try_verified_on_two_replicas_the_line_written_last_is_read(
    tmp_path: Path,
) -> None:
    # A queued row sent to replica-1 after the snapshot, verified, killed; the rerun sent
    # it to replica-0 (whose file is read first) under the same id and attempt.
    log(tmp_path, ("r1", 0, final_state(emails=2)), replica="replica-1")
    log(tmp_path, ("r1", 0, final_state()), replica="replica-0")
    assert check(tmp_path, trained("r1", attempt=0)) == []
    log(tmp_path, ("r2", 0, final_state()), replica="replica-0")
    log(tmp_path, ("r2", 0, final_state(emails=2)), replica="replica-1")
    assert [v.detail for v in check(tmp_path, trained("r2", attempt=0))] == [
        "applied 2 times: email to ana@example.com subject 'Team sync scheduled'"
    ]


def test_a_continued_rollout_missing_an_effect_is_a_violation(tmp_path: Path) -> None:
    log(tmp_path, ("r1", 1, final_state(emails=0)), ("r2", 0, final_state(emails=0)))
    found = check(tmp_path, trained("r1"), trained("r2", attempt=0))
    # Only the continued one had to finish its task ("continued").
    assert [(v.subject, v.detail) for v in found] == [
        (
            trained("r1").subject,
            "never applied: email to ana@example.com subject 'Team sync scheduled'",
        )
    ]


def test_a_trained_rollout_with_no_logged_state_and_a_bad_line_are_named(
    tmp_path: Path,
) -> None:
    log(tmp_path, ("r1", 1, final_state()))
    with (tmp_path / "resources-replica-0.jsonl").open("ab") as f:
        f.write(b'{"rollout_id": "r9", "att\n')  # a whole line that is not one
    found = check(tmp_path, trained("r1"), trained("r2"))
    assert len(found) == 2
    assert (
        found[0].subject == str(tmp_path) and "resources-replica-0.jsonl line 2" in found[0].detail
    )
    assert found[1].subject == trained("r2").subject
    assert "no resources server logged its final state" in found[1].detail


def test_a_line_torn_by_a_kill_is_skipped_and_cut_off_by_the_next_server(
    tmp_path: Path,
) -> None:
    # A server killed in the write: no newline, and its verify never replied.
    log(tmp_path, ("r1", 1, final_state()))
    path = tmp_path / "resources-replica-0.jsonl"
    with path.open("ab") as f:
        f.write(b'{"rollout_id": "r9", "att')
    assert check(tmp_path, trained("r1")) == []
    # The rerun's server on the same replica name appends whole lines after the cut, so
    # the torn bytes do not run into its first line (they did: a CI run's I2 "unreadable").
    log(tmp_path, ("r2", 1, final_state()))
    assert check(tmp_path, trained("r1"), trained("r2")) == []
    assert b"r9" not in path.read_bytes()
    assert len(path.read_bytes().splitlines()) == 2


def test_a_torn_line_longer_than_one_probe_is_cut_whole(tmp_path: Path) -> None:
    log(tmp_path, ("r1", 1, final_state()))
    path = tmp_path / "resources-replica-0.jsonl"
    whole = path.stat().st_size
    with path.open("ab") as f:
        f.write(b'{"rollout_id": "r9", "state": "' + b"x" * 200_000)
    log(tmp_path)
    assert path.stat().st_size == whole


def test_a_file_that_is_one_torn_line_is_emptied(tmp_path: Path) -> None:
    path = tmp_path / "resources-replica-0.jsonl"
    path.write_bytes(b'{"rollout_id": "r9"')
    log(tmp_path, ("r1", 1, final_state()))
    assert check(tmp_path, trained("r1")) == []
    assert path.read_bytes().startswith(b'{"ts"')


def test_a_write_the_kernel_takes_in_parts_still_writes_the_whole_line(
    tmp_path: Path,
) -> None:
    journal = FinalStateLog(tmp_path, "replica-0")
    real = journal._file

    class Partial:
        """A raw file whose writes take at most 1,000 bytes, as a raw write may."""

        def write(self, data: memoryview) -> int:
            return real.write(data[:1000]) or 0

    journal._file = Partial()  # type: ignore[assignment]
    journal.append(EpisodeId(rollout_id="r1", attempt=1), TASK.task_id, "workplace", final_state())
    real.close()
    assert check(tmp_path, trained("r1")) == []
