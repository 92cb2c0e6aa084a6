"""The faultyfile:// store: fsspec finds it by its entry point, and its writes fail, with
the errno asked for, exactly while its flag is up; reads always work."""

from __future__ import annotations

import errno
from pathlib import Path

import fsspec
import pytest

from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.testing.faulty_store import FaultyFileSystem, fail_writes, heal, store_url


def test_writes_under_the_root_fail_while_the_flag_is_up_and_reads_do_not(
    tmp_path: Path,
) -> None:
    root = tmp_path / "snapshots"
    root.mkdir()
    fs, path = fsspec.core.url_to_fs(store_url(root))
    assert isinstance(fs, FaultyFileSystem)  # through the fsspec.specs entry point
    fs.pipe_file(f"{path}/kept", b"before")

    fail_writes(root, "EIO")
    for write in (
        lambda: fs.pipe_file(f"{path}/a/new", b"x"),
        lambda: fs.makedirs(f"{path}/folder", exist_ok=True),
        lambda: fs.mv(f"{path}/kept", f"{path}/moved"),
        lambda: fs.rm_file(f"{path}/kept"),
    ):
        with pytest.raises(OSError) as caught:
            write()
        assert caught.value.errno == errno.EIO
    assert fs.cat_file(f"{path}/kept") == b"before"
    # A folder beside the root is another disk.
    other = tmp_path / "elsewhere"
    other.mkdir()
    fs.pipe_file(str(other / "free"), b"y")

    heal(root)
    fs.makedirs(f"{path}/a", exist_ok=True)
    fs.pipe_file(f"{path}/a/new", b"x")
    assert fs.cat_file(f"{path}/a/new") == b"x"


def test_a_snapshot_store_on_it_cannot_begin_a_snapshot_on_a_full_disk(tmp_path: Path) -> None:
    store = SnapshotStore(store_url(tmp_path / "snapshots"))
    fail_writes(tmp_path / "snapshots")
    with pytest.raises(Exception, match="No space left on device"):
        store.begin("snap-1")
    heal(tmp_path / "snapshots")
    store.abort(store.begin("snap-2"))
