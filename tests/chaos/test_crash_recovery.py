"""``rollpoint run`` SIGKILLed at chosen moments, rerun to the end, and held to the invariants
(docs/design.md#invariants).

Each test starts the real command in its own session, kills the whole process group
(trainer and every server) at a moment read off the workdir or the run's stderr, checks
that no process of the group survived, reruns the same command until it exits 0, and then
checks invariants I1 to I4 on the workdir (``rollpoint.testing.invariants``). The job is small
(16 workplace tasks, a 60 ms scripted policy that never blunders, a snapshot every 0.3 s)
so one run takes a few seconds.
"""

from __future__ import annotations

import hashlib
import random
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import orjson
import pytest

from rollpoint.app.config import load_config
from rollpoint.job.tasks import load_tasks_for
from rollpoint.protocol.episode import TaskRow
from rollpoint.testing import invariants
from tests.support.held_run import arm
from tests.support.job_config import write_job_config
from tests.support.run_process import Finished, RunProcess

pytestmark = pytest.mark.chaos

GROUP_SIZE = 2
MAX_RERUNS = 3
_CONTINUED = re.compile(r"(\d+)\s+episodes\s+continued")
_RESUMED_FROM = re.compile(r"resumed\s+from\s+snapshot\s+(\S+)")


def write_config(tmp_path: Path, **overrides: object) -> Path:
    return write_job_config(
        tmp_path,
        **{
            "tasks": 16,
            "group_size": GROUP_SIZE,
            "policy": {"latency_ms": 60, "error_rate": 0},
            "snapshot": {"every_seconds": 0.3},
            # I2 is counted from what each resources server held when it verified a rollout.
            "final_states_log": str(tmp_path / "final-states"),
            **overrides,
        },
    )


class Start(Protocol):
    """Start ``rollpoint run`` on a config (``launcher``: what runs the CLI)."""

    def __call__(self, config: Path, launcher: tuple[str, ...] = ...) -> RunProcess: ...


@pytest.fixture
def start() -> Iterator[Start]:
    """Start ``rollpoint run``; whatever a failed test leaves running is killed after it."""
    started: list[RunProcess] = []

    def _start(config: Path, launcher: tuple[str, ...] = ("-m", "rollpoint")) -> RunProcess:
        started.append(RunProcess(config, launcher=launcher))
        return started[-1]

    yield _start
    for run in started:
        if run.proc.poll() is None:
            run.kill()


# ---- what the workdir shows --------------------------------------------------------------------
def _store(workdir: Path) -> Path:
    return workdir / invariants.SNAPSHOT_STORE_DIR


def published(workdir: Path) -> set[str]:
    return {p.parent.name for p in (_store(workdir) / "snapshots").glob("*/manifest.json")}


def staging(workdir: Path) -> set[str]:
    folder = _store(workdir) / "staging"
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


def has_checkpoint(workdir: Path) -> bool:
    return any((workdir / "checkpoints").glob("step-*.json"))


# ---- driving runs --------------------------------------------------------------------------
def wait_for_resumable_snapshot(run: RunProcess, workdir: Path) -> None:
    """Until a snapshot is published after the first train checkpoint: the rerun then has
    trained rows to keep, finished-queue items to rewind and in-flight episodes to continue."""
    run.wait_until(lambda: has_checkpoint(workdir), "a train checkpoint")
    before = published(workdir)
    run.wait_until(lambda: bool(published(workdir) - before), "a snapshot after the checkpoint")


def held_at(point: str, marker: Path) -> tuple[str, ...]:
    """The launcher that holds the run at ``point`` (``tests/support/held_run.py``)."""
    return ("-m", "tests.support.held_run", point, str(marker))


def crash(run: RunProcess) -> None:
    assert run.proc.poll() is None, f"the run ended before the kill:\n{run.stderr[-2000:]}"
    survivors = run.kill()
    assert survivors == [], f"processes outlived the killed run: {survivors}"


def rerun_until_ok(start: Start, config: Path) -> list[Finished]:
    """The same command until it exits 0; a rerun that fails must fail with a clear line."""
    runs: list[Finished] = []
    while len(runs) < MAX_RERUNS:
        runs.append(start(config).finish())
        if runs[-1].returncode == 0:
            return runs
        assert "Traceback" not in runs[-1].stderr, runs[-1].stderr[-3000:]
    tails = "\n---\n".join(r.stderr[-1500:] for r in runs)
    raise AssertionError(f"{MAX_RERUNS} reruns failed:\n{tails}")


def assert_invariants(config_path: Path, final: Finished) -> None:
    config = load_config(config_path)
    found = invariants.check_workdir(
        config.workdir,
        load_tasks_for(config.job_settings()),
        config.group_size,
        resumed_since=final.started_at,
        full_reward="all",  # error_rate 0: every rollout must reach full reward
        final_states=config.final_states_log,
        store=config.snapshot.store,
    )
    assert found == [], invariants.report(found)


def continued(finished: Finished) -> int:
    match = _CONTINUED.search(finished.stderr)
    assert match, f"the rerun did not resume:\n{finished.stderr[-2000:]}"
    return int(match.group(1))


def attempts(workdir: Path) -> list[int]:
    rollouts, _ = invariants.read_train_data(workdir)
    return [r.attempt for r in rollouts]


def assert_a_changed_group_size_is_refused(tmp_path: Path, config: Path) -> None:
    """A rerun of a killed run with another ``group_size`` is refused naming it, and touches
    neither the trained rows nor the snapshots; the config is then put back. (On the
    scenario's killed workdir: a kill of its own cost a run.)"""
    workdir = tmp_path / "run"
    trained = (workdir / "train_data.jsonl").read_bytes()
    snapshots = published(workdir)
    write_config(tmp_path, group_size=GROUP_SIZE + 1)

    refused = RunProcess(config).finish()

    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "group_size" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert (workdir / "train_data.jsonl").read_bytes() == trained
    assert published(workdir) == snapshots
    write_config(tmp_path)


# ---- the scenarios -------------------------------------------------------------------------
def test_kill_between_snapshots_refuses_a_changed_group_size_then_continues_the_saved_episodes(
    tmp_path: Path, start: Start
) -> None:
    config = write_config(tmp_path)
    workdir = tmp_path / "run"
    run = start(config)
    wait_for_resumable_snapshot(run, workdir)
    crash(run)
    assert_a_changed_group_size_is_refused(tmp_path, config)

    reruns = rerun_until_ok(start, config)

    assert continued(reruns[0]) > 0, reruns[0].stderr[-2000:]
    assert max(attempts(workdir)) >= 1, "no continued episode reached training"
    assert_invariants(config, reruns[-1])


def test_restart_recovery_starts_saved_episodes_over(tmp_path: Path, start: Start) -> None:
    # The baseline mode: the same crash, but nothing continues mid-conversation.
    config = write_config(tmp_path, recovery="restart")
    workdir = tmp_path / "run"
    run = start(config)
    wait_for_resumable_snapshot(run, workdir)
    crash(run)

    reruns = rerun_until_ok(start, config)

    assert continued(reruns[0]) == 0, reruns[0].stderr[-2000:]
    match = re.search(r"(\d+)\s+restarted", reruns[0].stderr)
    assert match and int(match.group(1)) > 0, reruns[0].stderr[-2000:]
    assert max(attempts(workdir)) == 0, "restart recovery continued an episode"
    assert_invariants(config, reruns[-1])


def test_kill_during_a_save_resumes_from_the_previous_snapshot(
    tmp_path: Path, start: Start
) -> None:
    config = write_config(tmp_path)
    workdir = tmp_path / "run"
    held = tmp_path / "held-publish"
    run = start(config, launcher=held_at("publish", held))
    wait_for_resumable_snapshot(run, workdir)
    arm(held).touch()
    # The next save is written to its staging folder and held before it is published.
    run.wait_until(held.exists, "a snapshot written and not yet published")
    saving = staging(workdir) - published(workdir)
    assert saving, f"no staging folder while a save was held: {staging(workdir)}"
    crash(run)
    assert not saving & published(workdir), f"{saving} was published before the kill landed"

    reruns = rerun_until_ok(start, config)

    match = _RESUMED_FROM.search(reruns[0].stderr)
    assert match, reruns[0].stderr[-2000:]
    assert match.group(1) not in saving
    assert not saving & staging(workdir), "the torn snapshot's staging folder was left behind"
    assert_invariants(config, reruns[-1])


def test_kill_during_a_restore_then_rerun(tmp_path: Path, start: Start) -> None:
    config = write_config(tmp_path)
    workdir = tmp_path / "run"
    first = start(config)
    wait_for_resumable_snapshot(first, workdir)
    crash(first)
    snapshots = published(workdir)

    # Every participant has installed the snapshot; the trainer has not resumed.
    installed = tmp_path / "installed"
    restoring = start(config, launcher=held_at("restore", installed))
    restoring.wait_until(installed.exists, "the participants' install")
    crash(restoring)
    assert "resumed from" not in restoring.stderr, restoring.stderr[-2000:]
    assert published(workdir) == snapshots

    reruns = rerun_until_ok(start, config)

    assert _RESUMED_FROM.search(reruns[0].stderr), reruns[0].stderr[-2000:]
    assert_invariants(config, reruns[-1])


# 0.20 s into a run of about 2.5 s: before its first snapshot. A kill later in the run is
# a kill between snapshots or during a save (the tests above), and the chaos command's
# trials kill at drawn moments (tests/integration/test_chaos_command.py).
@pytest.mark.parametrize("seed", [1])
def test_kill_at_a_random_moment(tmp_path: Path, start: Start, seed: int) -> None:
    delay_s = random.Random(seed).uniform(0.0, 1.5)
    config = write_config(tmp_path)
    run = start(config)
    run.wait_until(lambda: "servers up" in run.stderr, "the servers")
    time.sleep(delay_s)
    crash(run)

    reruns = rerun_until_ok(start, config)

    assert_invariants(config, reruns[-1])


# ---- the checks themselves catch what they are for ------------------------------------------
def _transcript(title: str, *, creates: int = 1, listed: int = 1) -> list[dict[str, object]]:
    args = f'{{"title": "{title}", "date": "2025-01-15", "start_time": "10:00", "duration_minutes": 30}}'
    event = f'{{"title": "{title}", "date": "2025-01-15"}}'
    messages: list[dict[str, object]] = [{"role": "user", "content": "Schedule ..."}]
    for n in range(creates):
        messages += [
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": f"c{n}",
                        "type": "function",
                        "function": {"name": "calendar_create_event", "arguments": args},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": f"c{n}", "content": '{"status": "created"}'},
        ]
    messages += [
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "s",
                    "type": "function",
                    "function": {"name": "calendar_search_events", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "s", "content": f"[{', '.join([event] * listed)}]"},
        {"role": "assistant", "content": "Done."},
    ]
    return messages


def _line(
    row: int, *, attempt: int = 0, reward: float = 1.0, **transcript: int
) -> dict[str, object]:
    messages = _transcript("Team sync", **transcript)
    turns = sum(1 for m in messages if m["role"] == "assistant")
    return {
        "task_id": "workplace-0000",
        "group_id": "workplace-0000-g0",
        "row": row,
        "rollout_id": f"r{row}",
        "attempt": attempt,
        "reward": reward,
        "messages": messages,
        "turns": turns,
        "model_calls": [{"turn": t, "attempt": attempt} for t in range(turns)],
    }


GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "manifest"
SNAPSHOT = "snap-000042"  # the golden manifests' id


def test_the_invariant_checks_report_each_kind_of_violation(tmp_path: Path) -> None:
    task = TaskRow(
        task_id="workplace-0000",
        environment="workplace",
        prompt="Schedule ...",
        params={
            "events": [
                {
                    "title": "Team sync",
                    "date": "2025-01-15",
                    "start_time": "10:00",
                    "duration_minutes": 30,
                }
            ]
        },
    )
    regenerated = _line(1, attempt=1, creates=2)
    regenerated["model_calls"] = [{"turn": 0, "attempt": 1}, {"turn": 0, "attempt": 0}]
    lines = [_line(0, listed=2), _line(0), regenerated, _line(2, attempt=1, reward=0.5)]
    (tmp_path / "train_data.jsonl").write_bytes(
        b"".join(orjson.dumps(line) + b"\n" for line in lines)
    )
    (tmp_path / "metrics.jsonl").write_bytes(
        b"".join(
            orjson.dumps({"ts": ts, "event": "snapshot", "snapshot_id": sid, "outcome": outcome})
            + b"\n"
            for ts, sid, outcome in [(10.0, SNAPSHOT, "published"), (25.0, "s2", "failed")]
        )
    )

    found = invariants.by_kind(invariants.check_workdir(tmp_path, [task], 4, resumed_since=20.0))

    assert {v.subject for v in found[invariants.Invariant.EXACTLY_ONCE]} == {
        "workplace-0000-g0 row 0",  # twice
        "workplace-0000-g0 row 3",  # never
    }
    assert [v.subject.split()[2] for v in found[invariants.Invariant.SIDE_EFFECTS_ONCE]] == [
        "0",
        "2",  # listed twice; a continued rollout short of full reward
    ]
    assert len(found[invariants.Invariant.NO_REGENERATED_TURNS]) == 3
    assert all("r1#1" in v.subject for v in found[invariants.Invariant.NO_REGENERATED_TURNS])
    assert [v.detail for v in found[invariants.Invariant.SNAPSHOTS_COMMIT]] == [
        "tried 1 snapshot(s) but published none"
    ]
    # Published but not in the store, then with a manifest whose sealed train step was
    # flipped, then sound; a rerun that did nothing owes no snapshot.
    store = tmp_path / "elsewhere"  # the configured snapshot.store, not WORKDIR/snapshots
    assert [
        v.detail for v in invariants.check_snapshots_commit(tmp_path, since=5.0, store=str(store))
    ] == [f"published but not in {store}"]
    manifest = store / "snapshots" / SNAPSHOT / "manifest.json"
    manifest.parent.mkdir(parents=True)
    shutil.copy(GOLDEN / "snapshot_manifest_v4_flipped_train_step.json", manifest)
    (unreadable,) = invariants.check_snapshots_commit(tmp_path, since=5.0, store=str(store))
    assert unreadable.detail.startswith("published but unreadable: ")
    shutil.copy(GOLDEN / "snapshot_manifest_v5.json", manifest)
    assert invariants.check_snapshots_commit(tmp_path, since=5.0, store=str(store)) == []
    assert invariants.check_snapshots_commit(tmp_path, since=5.0) != []  # not in WORKDIR
    assert invariants.check_snapshots_commit(tmp_path, since=30.0) == []
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-00000001.json").write_bytes(
        orjson.dumps(
            {
                "schema_version": 1,
                "step": 1,
                "policy_version": 1,
                "train_data_bytes": 0,
                "episodes_trained": 4,
                "groups_trained": 1,
                "written_at": 40.0,
            }
        )
    )
    assert [v.detail for v in invariants.check_snapshots_commit(tmp_path, since=30.0)] == [
        "trained steps [1] but published none"
    ]
    # I1 from the checkpoints' digests: one that covers the first line, and one whose
    # digest the file no longer matches (a line edited after it was trained).
    first = len(orjson.dumps(lines[0])) + 1
    data = (tmp_path / "train_data.jsonl").read_bytes()
    for step, digest in [(2, hashlib.sha256(data[:first]).hexdigest()), (3, "0" * 64)]:
        (tmp_path / "checkpoints" / f"step-{step:08d}.json").write_bytes(
            orjson.dumps(
                {
                    "schema_version": 2,
                    "step": step,
                    "policy_version": step,
                    "train_data_bytes": first,
                    "train_data_lines": 1,
                    "train_data_sha256": digest,
                    "episodes_trained": 4,
                    "groups_trained": 1,
                    "written_at": 40.0,
                }
            )
        )
    (edited,) = invariants.check_train_data_digests(tmp_path)
    assert edited.kind is invariants.Invariant.EXACTLY_ONCE
    assert edited.subject == "train checkpoint step 3" and "a line was edited" in edited.detail
