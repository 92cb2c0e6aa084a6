"""Containment at open time: no file under a local store root is reached through a symlink."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpoint.protocol.errors import BadRequestError
from rollpoint.store.contained_filesystem import ContainedFilesystem, filesystem_within
from rollpoint.store.filesystem import FsspecFilesystem
from rollpoint.store.participant_state import read_participant_state, write_participant_state

IDENTITY = {"kind": "agent", "instance": "agent-0", "checkpoint_id": "c1"}


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, Path]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    return root, outside


def test_every_operation_refuses_a_symlinked_component(store: tuple[Path, Path]) -> None:
    root, outside = store
    (outside / "file").write_bytes(b"secret")
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "file-link").symlink_to(outside / "file")
    fs = ContainedFilesystem(str(root))
    through_folder, through_file = f"{root}/link/file", f"{root}/file-link"
    for operation in (
        lambda: fs.read_bytes(through_folder),
        lambda: fs.read_bytes(through_file),
        lambda: fs.size(through_file),
        lambda: fs.write_bytes(through_file, b"x"),
        lambda: fs.write_bytes(f"{root}/link/new", b"x"),
        lambda: fs.makedirs(f"{root}/link/deeper"),
        lambda: fs.publish_bytes(f"{root}/link/manifest.json", b"{}"),
        lambda: fs.exists(f"{root}/link/file"),
    ):
        with pytest.raises(BadRequestError, match=r"through a symlink at '(link|file-link)'"):
            operation()
    assert sorted(p.name for p in outside.iterdir()) == ["file"]
    assert (outside / "file").read_bytes() == b"secret"


def test_plain_files_and_folders_work_and_the_root_may_be_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real, target_is_directory=True)
    fs = ContainedFilesystem(str(tmp_path / "alias" / "store"))
    folder = f"{tmp_path}/alias/store/a/b"
    fs.makedirs(folder)
    fs.publish_bytes(f"{folder}/m.json", b"{}")
    fs.publish_bytes(f"{folder}/m.json", b"[]")
    assert fs.read_bytes(f"{folder}/m.json") == b"[]" and fs.size(f"{folder}/m.json") == 2
    assert fs.exists(f"{folder}/m.json") and not fs.exists(f"{folder}/none")
    assert fs.isdir(folder) and (real / "store" / "a" / "b" / "m.json").exists()
    with pytest.raises(BadRequestError, match="is not inside the store"):
        fs.read_bytes(str(tmp_path / "real" / "elsewhere"))


def test_participant_state_stays_in_its_root(store: tuple[Path, Path]) -> None:
    root, outside = store
    directory = f"{root}/snap/agent/agent-0"
    write_participant_state(directory, records=[{"n": 1}], root=str(root), **IDENTITY)
    assert read_participant_state(directory, root=str(root), **IDENTITY)[1] == [{"n": 1}]
    (root / "snap").rename(outside / "snap")
    (root / "snap").symlink_to(outside / "snap", target_is_directory=True)
    with pytest.raises(BadRequestError, match="symlink at 'snap'"):
        read_participant_state(directory, root=str(root), **IDENTITY)
    with pytest.raises(BadRequestError, match="symlink at 'snap'"):
        write_participant_state(f"{root}/snap/x/y", records=[], root=str(root), **IDENTITY)


def test_an_fsspec_root_is_served_as_before() -> None:
    assert isinstance(filesystem_within("memory://bucket", "memory://bucket/a"), FsspecFilesystem)
