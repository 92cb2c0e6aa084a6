"""A damaged shared records file costs no more than the snapshots already naming it
(issue 33, item 2): a new snapshot never references it again. Its size is checked before
every write, its bytes re-hashed on a schedule (``REVERIFY_S``); the records it held are
written again from memory, with a warning, and the index counts it."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from rollpoint.store import record_packs
from rollpoint.store.record_packs import OBJECTS_DIR, PackIndex
from rollpoint.store.snapshot_store import SnapshotStore
from tests.unit.store.test_trainer_records import NAME, _records, _snapshot


def _pack(root: Path) -> Path:
    (pack,) = [p for p in (root / OBJECTS_DIR).iterdir() if p.name.startswith("records-")]
    return pack


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 3)


@pytest.mark.parametrize("damage", [_flip, _truncate, Path.unlink])
def test_a_new_snapshot_never_names_a_damaged_records_file(
    tmp_path: Path,
    damage: object,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(record_packs, "REVERIFY_S", 0.0)  # every write re-hashes
    root = tmp_path / "store"
    store, index = SnapshotStore(str(root), keep=5), PackIndex()
    records = _records(100)
    _snapshot(store, "s1", records, index)
    damaged = _pack(root)
    damage(damaged)  # type: ignore[operator]

    with caplog.at_level(logging.WARNING, logger="rollpoint.store"):
        changed = [*records[:-1], {"try": {"row": 99, "turn": 1}}]
        _snapshot(store, "s2", changed, index)

    assert damaged.name not in (root / "snapshots" / "s2" / "trainer" / NAME).read_text()
    store.verify("s2")
    assert store.read_records("s2", NAME) == changed
    assert f"records file {damaged} is damaged" in caplog.text
    assert index.damaged == 1


def test_without_a_rehash_due_only_the_size_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(record_packs, "REHASH_BELOW_BYTES", 0)  # a big file's schedule
    root = tmp_path / "store"
    store, index = SnapshotStore(str(root), keep=5), PackIndex()
    records = _records(100)
    _snapshot(store, "s1", records, index)
    _snapshot(store, "s2", records, index)
    assert index.damaged == 0  # whole files are referenced again, not rewritten
    assert len(list((root / OBJECTS_DIR).iterdir())) == 1


def test_a_small_records_file_is_re_hashed_before_every_write(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No re-hash due (``REVERIFY_S``: the file was just written), but the file is small
    (a trainer's ledger pack): a byte flipped in it is found before the next snapshot
    would name it, which writes the records again from memory."""
    root = tmp_path / "store"
    store, index = SnapshotStore(str(root), keep=5), PackIndex()
    records = _records(100)
    _snapshot(store, "s1", records, index)
    _snapshot(store, "s2", records, index)  # the second write rebases: the same file
    damaged = _pack(root)
    assert damaged.stat().st_size <= record_packs.REHASH_BELOW_BYTES
    _flip(damaged)

    with caplog.at_level(logging.WARNING, logger="rollpoint.store"):
        changed = [*records[:-1], {"try": {"row": 99, "turn": 1}}]
        _snapshot(store, "s3", changed, index)

    assert damaged.name not in (root / "snapshots" / "s3" / "trainer" / NAME).read_text()
    store.verify("s3")
    assert store.read_records("s3", NAME) == changed
    assert f"records file {damaged} is damaged" in caplog.text
    assert index.damaged == 1


def _snapshots_with_one_changing_record(
    tmp_path: Path, count: int
) -> tuple[Path, SnapshotStore, list[dict[str, Any]], Path]:
    """``count`` snapshots s1... (keep 2) of 200 trainer records, the last one changed in
    each: the store's root, the store, the last records, and the biggest records file the
    newest snapshot names (the one most snapshots share)."""
    root = tmp_path / "store"
    store, index = SnapshotStore(str(root), keep=2), PackIndex()
    records = _records(200)
    for n in range(1, count + 1):
        records = [*records[:-1], {"try": {"row": 199, "turn": n}}]
        _snapshot(store, f"s{n}", records, index)
    newest = (root / "snapshots" / f"s{count}" / "trainer" / NAME).read_text()
    biggest = max(
        (p for p in (root / OBJECTS_DIR).iterdir() if p.name in newest),
        key=lambda p: p.stat().st_size,
    )
    return root, store, records, biggest


def test_one_damaged_shared_file_falls_back_to_a_snapshot_that_does_not_name_it(
    tmp_path: Path,
) -> None:
    """Every kept snapshot named the biggest records file, so damaging it lost the run;
    the store now keeps a fallback sharing no records file with the newest."""
    root, store, _, biggest = _snapshots_with_one_changing_record(tmp_path, 9)
    _flip(biggest)

    survivor = store.latest()

    assert survivor is not None, "one damaged records file took every snapshot down"
    trainer_file = root / "snapshots" / survivor.snapshot_id / "trainer" / NAME
    assert biggest.name not in trainer_file.read_text()
    assert store.read_records(survivor.snapshot_id, NAME)


@pytest.mark.usefixtures("no_early_rebase")  # s1 to s3 all name the first pack
def test_inspect_names_the_damaged_file_and_the_snapshots_it_takes_down(tmp_path: Path) -> None:
    from rollpoint.app.snapshot_report import build_report

    root = tmp_path / "store"
    store, index = SnapshotStore(str(root), keep=3), PackIndex()
    records = _records(100)
    for n in (1, 2, 3):
        records = [*records[:-1], {"try": {"row": 99, "turn": n}}]
        _snapshot(store, f"s{n}", records, index)
    # The first pack: every later snapshot still names its unchanged records.
    base = min((root / OBJECTS_DIR).iterdir(), key=lambda p: p.stat().st_mtime_ns)
    _flip(base)

    report = build_report(str(root))

    assert report["damaged_files"] == {str(base): ["s3", "s2", "s1"]}


@pytest.mark.parametrize("damage", [_flip, Path.unlink])
def test_a_fallback_is_kept_from_the_second_snapshot_on(tmp_path: Path, damage: object) -> None:
    """The second write rebases (record_packs.FIRST_REBASE): with four snapshots, the file
    the newest three share damaged, the first still restores. Before, every snapshot named
    the first write's file until the eighth, and a chaos trial whose run was killed right
    after such a damage (found by a re-hash only 30 s later) lost the run."""
    root, store, records, shared = _snapshots_with_one_changing_record(tmp_path, 4)
    assert shared.name in (root / "snapshots" / "s3" / "trainer" / NAME).read_text()
    assert not (root / "snapshots" / "s2").exists()  # keep=2: s4, s3 and the fallback s1
    damage(shared)  # type: ignore[operator]

    survivor = store.latest()

    assert survivor is not None and survivor.snapshot_id == "s1"
    assert store.read_records("s1", NAME)[:199] == records[:199]


def test_the_train_checkpoint_the_fallback_composes_with_is_kept_too(tmp_path: Path) -> None:
    """Chaos (``pack_damage``, its first campaign): the store kept its fallback, but the
    trainer's checkpoint retention did not know it and deleted the train checkpoint it
    composes with; the damage then left no snapshot a rerun could use, and every rerun
    was refused."""
    from types import SimpleNamespace

    from rollpoint.trainer.train_loop import TrainLoop
    from tests.unit.store.test_trainer_records import _manifest, _write

    store, index = SnapshotStore(str(tmp_path / "store"), keep=2), PackIndex()
    records = _records(200)
    steps = list(range(1, 12))
    for n in steps:  # one snapshot per train step; the 8th write of the index rebases
        records = [*records[:-1], {"try": {"row": 199, "turn": n}}]
        staging, entry = _write(store, f"s{n}", records, index)
        manifest = _manifest(f"s{n}", {NAME: entry})
        store.publish(staging, manifest.model_copy(update={"train_step": n, "committed_step": n}))
    (fallback,) = store.kept_fallback
    assert fallback not in {s.snapshot_id for s in store.spans()[: store.keep]}
    span = next(s for s in store.spans() if s.snapshot_id == fallback)
    trainer = SimpleNamespace(
        coordinator=SimpleNamespace(store=store),
        step_record=SimpleNamespace(steps=lambda: steps, keep=2),
    )

    kept = TrainLoop._steps_to_keep(trainer, 12)  # type: ignore[arg-type]

    assert any(span.composes_with(step) for step in kept), (fallback, sorted(kept))
