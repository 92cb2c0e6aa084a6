"""``rollpoint run`` refuses, in one line and before any server starts, what it cannot use.

Paths are made unusable in ways that hold for every user, root included (a regular file where
a folder must be, a symbolic-link loop), since permission bits do not stop root.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.process


def _run(tmp_path: Path, **config: object) -> subprocess.CompletedProcess[str]:
    doc = {"tasks": 2, "group_size": 2, "replicas": 1, "concurrency": 2, **config}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return subprocess.run(
        [sys.executable, "-m", "rollpoint", "run", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "240"},
    )


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(lines) == 1, result.stderr[-2000:]  # not even "servers up": nothing started
    return lines[0]


def test_a_workdir_that_cannot_be_written_is_one_line_naming_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    workdir = tmp_path / "file" / "run"
    result = _run(tmp_path, workdir=str(workdir))
    assert result.returncode == 2
    assert f"error: workdir {workdir} is not writable: Not a directory" in _one_line(result)


def test_a_snapshot_store_that_cannot_be_written_is_one_line_before_any_server(
    tmp_path: Path,
) -> None:
    (tmp_path / "file").write_text("not a folder")
    store = tmp_path / "file" / "store"
    result = _run(tmp_path, workdir=str(tmp_path / "run"), snapshot={"store": str(store)})
    assert result.returncode == 2
    assert f"error: snapshot.store {store} is not writable" in _one_line(result)
    assert not (tmp_path / "run" / "logs").exists(), "servers were started"


def test_a_snapshot_store_that_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (store / "snapshots").symlink_to(store / "snapshots")  # a loop: ELOOP on every read
    result = _run(tmp_path, workdir=str(tmp_path / "run"), snapshot={"store": str(store)})
    assert result.returncode == 2
    line = _one_line(result)
    # The store is read through the contained filesystem (issue 33): the link is refused
    # as such, never followed.
    assert f"cannot read the snapshot store {store}: " in line
    assert "goes through a symlink at 'snapshots'" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="permission bits do not stop root")
def test_a_read_only_snapshot_store_is_refused_before_any_server(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o500)
    try:
        result = _run(tmp_path, workdir=str(tmp_path / "run"), snapshot={"store": str(store)})
    finally:
        store.chmod(0o700)
    assert result.returncode == 2
    assert f"error: snapshot.store {store} is not writable: Permission denied" in _one_line(result)
