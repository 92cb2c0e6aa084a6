"""A trainer file of a snapshot kept as records: written once, then referenced, like a participant's state.

Owns the trainer files whose entry has ``format`` ``records``: the file in the snapshot
folder is a :class:`~rollpoint.protocol.manifest.TrainerFileManifest` naming parts of the
store's shared records files (:mod:`rollpoint.store.record_packs`), and a write adds one
pack of the records its previous write (its :class:`~rollpoint.store.record_packs.PackIndex`)
did not hold. The ledger and the finished queue are kept this way: between two snapshots a few of their
records change (the live tries, the groups that finished), and the rest (full chunks of
final tries, ready groups) are referenced where an earlier snapshot wrote them. Measured by
``snapshot_growth``: rewritten whole, they were 20.7 MB of the 38.9 MB a 10k-session
snapshot wrote.

Reading checks the manifest's name and checkpoint id, then every part (size, digest, line
count) before returning a record; retention finds the shared files a trainer file names
through :func:`trainer_shared_files`.

It does not know what a record means (:mod:`rollpoint.trainer.state.ledger_document` and
:mod:`rollpoint.trainer.state.finished_queue` make and join them) nor where in the snapshot
folder the file sits (:mod:`rollpoint.store.snapshot_store`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from rollpoint.protocol.errors import InvalidCheckpointStateError, SnapshotError
from rollpoint.protocol.manifest import (
    FileEntry,
    TrainerFileManifest,
    decode_document,
    encode_document,
    load_trainer_file_manifest,
)
from rollpoint.store.filesystem import Filesystem
from rollpoint.store.pack_reads import check_identity, check_totals, read_parts
from rollpoint.store.record_packs import (
    OBJECTS_DIR,
    PackIndex,
    pack_records,
    records_manifest,
)

__all__ = [
    "read_trainer_records",
    "trainer_shared_files",
    "verify_trainer_records",
    "write_trainer_records",
]


def write_trainer_records(
    fs: Filesystem,
    root: str,
    path: str,
    *,
    name: str,
    relative: str,
    snapshot_id: str,
    records: Sequence[Mapping[str, Any]],
    index: PackIndex,
) -> FileEntry:
    """Write ``records`` into the root's shared records files and their manifest at
    ``path`` (``relative`` to the snapshot folder); ``index`` becomes this write's."""
    try:
        packed = pack_records(fs, fs.join(root, OBJECTS_DIR), records, index, shared=True)
        manifest = records_manifest(TrainerFileManifest, packed, name=name, snapshot_id=snapshot_id)
        data = encode_document(manifest)
        fs.makedirs(path.rsplit("/", 1)[0])
        with fs.open_write(path) as stream:
            stream.write(data)
    except OSError as exc:
        raise SnapshotError(f"cannot write {path}: {exc}") from None
    index.replace(packed.index)
    return FileEntry(
        path=relative,
        sha256=hashlib.sha256(data).hexdigest(),
        bytes=len(data),
        format="records",
    )


def read_trainer_records(
    fs: Filesystem, root: str, path: str, data: bytes, *, name: str, snapshot_id: str
) -> list[dict[str, Any]]:
    """The records of the trainer file whose manifest (read from ``path``, its digest
    already checked) is ``data``; every part verified before any is returned."""
    records: list[dict[str, Any]] = []
    _read(fs, root, path, _manifest(data, path, name, snapshot_id), into=records)
    return records


def verify_trainer_records(
    fs: Filesystem, root: str, path: str, data: bytes, *, name: str, snapshot_id: str
) -> None:
    """Check the parts :func:`read_trainer_records` would read, decoding nothing."""
    _read(fs, root, path, _manifest(data, path, name, snapshot_id), into=None)


def trainer_shared_files(data: bytes, path: str) -> set[str]:
    """The shared records files the trainer file manifest ``data`` names."""
    return {part.file for part in _load(data, path).parts if part.shared}


def _read(
    fs: Filesystem,
    root: str,
    path: str,
    manifest: TrainerFileManifest,
    *,
    into: list[dict[str, Any]] | None,
) -> None:
    directory = path.rsplit("/", 1)[0]
    objects = fs.join(root, OBJECTS_DIR)
    read_parts(fs, manifest.parts, directory=directory, objects=objects, into=into)


def _load(data: bytes, path: str) -> TrainerFileManifest:
    what = f"trainer file manifest {path}"
    return load_trainer_file_manifest(decode_document(data, what), what)


def _manifest(data: bytes, path: str, name: str, snapshot_id: str) -> TrainerFileManifest:
    manifest = _load(data, path)
    found = {"name": manifest.name, "snapshot_id": manifest.snapshot_id}
    expected = {"name": name, "snapshot_id": snapshot_id}
    check_identity(path, found, expected)
    unshared = [part.file for part in manifest.parts if not part.shared]
    if unshared:
        raise InvalidCheckpointStateError(
            f"{path}: names {unshared[0]} outside the shared records files ({OBJECTS_DIR}/)"
        )
    check_totals(manifest, path)
    return manifest
