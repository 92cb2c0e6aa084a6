"""The snapshot store works through the contained filesystem (issue 33, item 3): with
``<store>/objects`` swapped for a symlink after a publication, the trainer's records are
not written into the folder it names and retention's sweep deletes nothing there; and the
sweep deletes only records files the store itself named, never a file someone else put."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rollpoint.protocol.errors import BadRequestError
from rollpoint.store.record_packs import OBJECTS_DIR, PackIndex
from rollpoint.store.snapshot_store import SnapshotStore
from tests.unit.store.test_trainer_records import _records, _snapshot

pytestmark = pytest.mark.usefixtures("no_early_rebase")


def test_a_symlinked_objects_folder_gets_no_records_and_loses_no_file(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store, index = SnapshotStore(str(root), keep=1), PackIndex()
    _snapshot(store, "s1", _records(50), index)
    outside = tmp_path / "elsewhere"
    shutil.copytree(root / OBJECTS_DIR, outside)
    (outside / "unrelated.txt").write_text("not the store's")
    shutil.rmtree(root / OBJECTS_DIR)
    os.symlink(outside, root / OBJECTS_DIR)
    before = sorted(p.name for p in outside.iterdir())

    with pytest.raises(BadRequestError, match="symlink at 'objects'"):
        _snapshot(store, "s2", _records(50, turn=1), index)

    assert sorted(p.name for p in outside.iterdir()) == before


def test_the_sweep_deletes_only_records_files_the_store_named(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store, index = SnapshotStore(str(root), keep=1), PackIndex()
    _snapshot(store, "s1", _records(50), index)
    objects = root / OBJECTS_DIR
    foreign = ["notes.txt", "records-backup.jsonl", ".hidden", "records-0123456789abcdef.json"]
    for name in foreign:
        (objects / name).write_text("someone else's")
    old = os.path.getmtime(objects) - 3600
    for name in foreign:
        os.utime(objects / name, (old, old))

    _snapshot(store, "s2", _records(50, turn=1), index)
    _snapshot(store, "s3", _records(50, turn=2), index)

    left = {p.name for p in objects.iterdir()}
    assert set(foreign) <= left
    assert store.read_records("s3", "ledger.json") == _records(50, turn=2)
    assert {p.name for p in objects.iterdir() if p.name.startswith("records-")} - set(foreign), (
        "the store's own records files are still swept as before"
    )


def test_pruning_a_snapshot_never_follows_a_symlink_inside_it(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store, index = SnapshotStore(str(root), keep=1), PackIndex()
    _snapshot(store, "s1", _records(5), index)
    target = tmp_path / "precious"
    target.mkdir()
    (target / "data.txt").write_text("keep")
    os.symlink(target, root / "snapshots" / "s1" / "link")

    _snapshot(store, "s2", _records(5, turn=1), index)

    assert not (root / "snapshots" / "s1").exists()
    assert (target / "data.txt").read_text() == "keep"
