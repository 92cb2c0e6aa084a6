"""``rollpoint run`` when the run directory itself is touched (issue 15): two reruns at
once, a tampered manifest, a full snapshot disk, an edited or truncated train data file,
snapshots moved away or unusable.

Each test drives the real command as a process (``tests/support/run_process.py``), breaks
the workdir the way an operator or a scheduler would, and checks what the rerun did from
the workdir: invariants I1 to I4 when it must resume, the files left untouched when it
must refuse.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from tests.chaos.test_crash_recovery import (
    Start,
    assert_invariants,
    crash,
    rerun_until_ok,
    start,
    wait_for_resumable_snapshot,
    write_config,
)
from tests.support.full_disk import FullDisk, InjectedDisk, tmpfs_at
from tests.support.run_process import RunProcess

pytestmark = pytest.mark.chaos

__all__ = ["start"]  # the fixture, shared with the crash tests

_BUSY = re.compile(r"workdir \S+ is in use by process (\d+)")


# ---- what the workdir holds ----------------------------------------------------------------
def manifests(workdir: Path) -> dict[str, dict[str, object]]:
    """Every published snapshot's manifest document, by snapshot id."""
    folder = workdir / "snapshots" / "snapshots"
    return {p.parent.name: orjson.loads(p.read_bytes()) for p in folder.glob("*/manifest.json")}


def progress(workdir: Path) -> dict[Path, bytes]:
    """train_data.jsonl and every train checkpoint, as bytes."""
    files = [workdir / "train_data.jsonl", *(workdir / "checkpoints").glob("step-*.json")]
    return {p: p.read_bytes() for p in files}


def checkpoint_steps(workdir: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in (workdir / "checkpoints").glob("step-*.json"))


def test_a_flipped_train_step_in_a_manifest_is_skipped_on_the_console(
    tmp_path: Path, start: Start
) -> None:
    config = write_config(tmp_path, snapshot={"every_seconds": 0.3, "keep": 20})
    workdir = tmp_path / "run"
    run = start(config)
    run.wait_until(lambda: len(checkpoint_steps(workdir)) >= 3, "three train checkpoints")
    crash(run)
    # As if the kill landed between the last train checkpoint and its snapshot: the newest
    # snapshot is one step behind the newest checkpoint. Then one digit of its train step is
    # flipped to that checkpoint's step, so an unsealed manifest would compose with it.
    top = checkpoint_steps(workdir)[-1]
    docs = manifests(workdir)
    for sid, doc in docs.items():
        if int(doc["train_step"]) >= top:  # type: ignore[call-overload]
            shutil.rmtree(workdir / "snapshots" / "snapshots" / sid)
    left = {sid: doc for sid, doc in docs.items() if int(doc["train_step"]) < top}  # type: ignore[call-overload]
    newest = max(left, key=lambda sid: float(left[sid]["published_at"]))  # type: ignore[arg-type]
    assert int(left[newest]["train_step"]) >= 1, left[newest]  # type: ignore[call-overload]
    path = workdir / "snapshots" / "snapshots" / newest / "manifest.json"
    text = path.read_text()
    flipped = text.replace(f'"train_step": {left[newest]["train_step"]}', f'"train_step": {top}')
    assert flipped != text
    path.write_text(flipped)

    reruns = rerun_until_ok(start, config)

    assert f"warning: skipping snapshot {newest}:" in reruns[0].stderr, reruns[0].stderr[-2000:]
    assert "field 'train_step'" in reruns[0].stderr
    resumed = re.search(r"resumed\s+from\s+snapshot\s+(\S+)", reruns[0].stderr)
    assert resumed and resumed.group(1) != newest, reruns[0].stderr[-2000:]
    assert_invariants(config, reruns[-1])


def _edit_a_line(workdir: Path) -> None:
    """Change one character of a covered row, keeping the file's size."""
    path = workdir / "train_data.jsonl"
    data = path.read_bytes()
    at = data.index(b'"reward":') + len(b'"reward":')
    digit = data[at : at + 1]
    swapped = b"0" if digit != b"0" else b"1"
    path.write_bytes(data[:at] + swapped + data[at + 1 :])


def _truncate_mid_line(workdir: Path) -> None:
    path = workdir / "train_data.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[: data.index(b"\n") + 40])


def _checkpoints_500_bytes_short(workdir: Path) -> None:
    """Every checkpoint's length 500 bytes short: on main the rerun cut mid-line (exit 0)."""
    for path in (workdir / "checkpoints").glob("step-*.json"):
        doc = orjson.loads(path.read_bytes())
        if doc["train_data_bytes"] > 500:
            doc["train_data_bytes"] -= 500
            path.write_bytes(orjson.dumps(doc))


DAMAGES: dict[str, Callable[[Path], None]] = {
    "edited-line": _edit_a_line,
    "truncated-file": _truncate_mid_line,
    "checkpoint-500-bytes-short": _checkpoints_500_bytes_short,
}


# ---- a full snapshot disk, and a workdir whose snapshots are gone ---------------------------
@pytest.fixture
def disk(tmp_path: Path) -> Iterator[FullDisk]:
    """``WORKDIR/snapshots`` on a disk the test fills and frees: a real tmpfs where one can
    be mounted, else the trainer's store writes failing with ENOSPC (tests/support/full_disk).
    One of the two, not both: the run sees the same ENOSPC either way, and each test is a
    run, a kill and reruns (a process-level test's cost, paid once)."""
    with tmpfs_at(tmp_path / "run" / "snapshots") as mounted:
        if mounted is not None:
            yield mounted
            mounted.free()
            return
    injected = InjectedDisk(tmp_path)
    yield injected
    injected.free()


def published_steps(workdir: Path) -> list[int]:
    return sorted(int(doc["train_step"]) for doc in manifests(workdir).values())  # type: ignore[call-overload]


def test_a_full_snapshot_disk_for_longer_than_a_checkpoint_interval_then_the_rerun_resumes(
    tmp_path: Path, start: Start, disk: FullDisk
) -> None:
    # Failures never stop this run: its train checkpoints go on while no snapshot can publish.
    config = write_config(
        tmp_path, tasks=24, snapshot={"every_seconds": 0.3, "retry_after_seconds": 600}
    )
    workdir = tmp_path / "run"
    run = RunProcess(config, launcher=disk.launcher)
    try:
        wait_for_resumable_snapshot(run, workdir)
        disk.fill()
        last = published_steps(workdir)[-1]
        # Past the checkpoint retention (3) of the last snapshot that published.
        run.wait_until(
            lambda: checkpoint_steps(workdir)[-1] >= last + 4,
            "train checkpoints four steps past the last snapshot",
        )
        assert published_steps(workdir)[-1] == last, "a snapshot published on a full disk"
        crash(run)
    finally:
        if run.proc.poll() is None:
            run.kill()
    trained = (workdir / "train_data.jsonl").read_bytes()
    disk.free()

    reruns = rerun_until_ok(start, config)

    assert "resumed from snapshot" in reruns[0].stderr, reruns[0].stderr[-2000:]
    first_row = trained[: trained.index(b"\n") + 1]
    assert (workdir / "train_data.jsonl").read_bytes().startswith(first_row), "train data deleted"
    assert_invariants(config, reruns[-1])


def test_failed_snapshots_on_a_full_disk_stop_the_run_with_one_line_saying_what_to_free(
    tmp_path: Path, start: Start, disk: FullDisk
) -> None:
    config = write_config(
        tmp_path, tasks=24, snapshot={"every_seconds": 0.3, "retry_after_seconds": 0.5}
    )
    workdir = tmp_path / "run"
    run = RunProcess(config, launcher=disk.launcher)
    try:
        wait_for_resumable_snapshot(run, workdir)
        disk.fill()
        stopped = run.finish()
    finally:
        if run.proc.poll() is None:
            run.kill()

    assert stopped.returncode == 1, stopped.stderr[-2000:]
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stopped.stderr[-3000:]
    assert "snapshots failed in a row" in errors[0] and "(the disk is full)" in errors[0]
    assert "free space there" in errors[0] and len(errors[0]) < 400, errors[0]
    assert "Traceback" not in stopped.stderr

    disk.free()
    reruns = rerun_until_ok(start, config)
    assert "resumed from snapshot" in reruns[0].stderr, reruns[0].stderr[-2000:]
    assert_invariants(config, reruns[-1])


def _move_the_store(workdir: Path) -> Callable[[], None]:
    store = workdir / "snapshots"
    away = workdir.parent / "moved-store"
    store.rename(away)
    return lambda: away.rename(store)


def _corrupt_every_manifest(workdir: Path) -> Callable[[], None]:
    saved = {}
    for sid in manifests(workdir):
        path = workdir / "snapshots" / "snapshots" / sid / "manifest.json"
        saved[path] = path.read_bytes()
        path.write_bytes(saved[path].replace(b'"policy_version": ', b'"policy_version": 1'))

    def put_back() -> None:
        for path, data in saved.items():
            path.write_bytes(data)

    return put_back


LOSSES = [(_move_the_store, "but no snapshot in"), (_corrupt_every_manifest, "is unusable: snap-")]
"""Each way a workdir's snapshots can go, and what the refusal says of it."""


def test_a_killed_workdir_damaged_each_way_is_refused_then_two_reruns_at_once_resume_once(
    tmp_path: Path, start: Start
) -> None:
    """One killed run's workdir, broken each way in turn, put back between (a rerun refused
    at its start checks costs seconds, a run to the kill ~20):

    - its train data damaged (``DAMAGES``): refused in one line naming the file;
    - its snapshots lost (``LOSSES``): refused in one line saying why and the ways out;

    each time with nothing deleted or changed. Then, put back, two reruns at once (a
    scheduler retrying while the old job is torn down): one is refused before touching
    anything, naming the process that holds the workdir; the other resumes."""
    config = write_config(tmp_path)
    workdir = tmp_path / "run"
    run = start(config)
    run.wait_until(lambda: len(checkpoint_steps(workdir)) >= 2, "two train checkpoints")
    wait_for_resumable_snapshot(run, workdir)
    crash(run)
    train_data = workdir / "train_data.jsonl"
    good = progress(workdir)
    snapshots = set(manifests(workdir))

    for name, damage in DAMAGES.items():
        damage(workdir)
        kept = progress(workdir)

        refused = start(config).finish()

        assert refused.returncode != 0, (name, refused.stderr[-2000:])
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and str(train_data) in errors[0], (name, refused.stderr[-2000:])
        assert "Traceback" not in refused.stderr and "servers up" not in refused.stderr, name
        assert progress(workdir) == kept and set(manifests(workdir)) == snapshots, name
        # The first way out: put the files back as they were.
        for path, data in good.items():
            path.write_bytes(data)

    for lose, why in LOSSES:
        put_back = lose(workdir)

        refused = start(config).finish()

        assert refused.returncode != 0, refused.stderr[-2000:]
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, refused.stderr[-3000:]
        assert "holds progress (train_data.jsonl:" in errors[0] and why in errors[0], errors[0]
        assert "fix the snapshot store" in errors[0] and "--fresh --force" in errors[0]
        assert "Traceback" not in refused.stderr and "servers up" not in refused.stderr
        assert progress(workdir) == good
        put_back()
    assert set(manifests(workdir)) == snapshots

    both = [RunProcess(config), RunProcess(config)]
    try:
        finished = [r.finish() for r in both]
    finally:
        for r in both:
            if r.proc.poll() is None:
                r.kill()

    codes = sorted(f.returncode for f in finished)
    assert codes[0] == 0 and codes[1] != 0, [f.stderr[-1500:] for f in finished]
    loser = next(f for f in finished if f.returncode != 0)
    winner = next(r for r, f in zip(both, finished, strict=True) if f.returncode == 0)
    busy = _BUSY.search(loser.stderr)
    assert busy and int(busy.group(1)) == winner.proc.pid, loser.stderr[-1500:]
    assert "Traceback" not in loser.stderr
    assert "servers up" not in loser.stderr and "restoring" not in loser.stderr
    resumed = finished[both.index(winner)]
    assert "resumed from snapshot" in resumed.stderr, resumed.stderr[-2000:]
    assert_invariants(config, resumed)
