"""Store fixtures: every store test runs on a local folder and on an fsspec URL."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollpoint.store import record_packs
from rollpoint.store.filesystem import Filesystem, filesystem_for


@pytest.fixture(params=["local", "memory"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty root: a tmp folder, or a unique ``memory://`` URL removed afterwards."""
    if request.param == "local":
        yield str(tmp_path / "root")
        return
    url = f"memory://rollpoint-test-{uuid.uuid4().hex}"
    yield url
    filesystem_for(url).remove_tree(url)


@pytest.fixture
def no_early_rebase(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes incremental from the second on, as before the early rebase: for the tests of
    what an incremental write references (``record_packs.FIRST_REBASE`` makes the second
    write a full one; test_damaged_records tests that)."""
    monkeypatch.setattr(record_packs, "FIRST_REBASE", -1)


def _flip_byte(path: str, offset: int = 0) -> None:
    fs: Filesystem = filesystem_for(path)
    data = bytearray(fs.read_bytes(path))
    data[offset] ^= 0x01
    fs.write_bytes(path, bytes(data))


@pytest.fixture
def flip_byte() -> Callable[..., None]:
    """``flip_byte(path, offset=0)``: corrupt one byte of a file in place, on either backend."""
    return _flip_byte
