"""Damage to a published snapshot between a crash and its rerun, as a disk, a copy gone wrong
or a hand edit leaves it: what ``rollpoint chaos``'s ``snapshot_tamper`` fault does; and
damage to the shared records file most snapshots name (``pack_damage`` at rest,
``pack_damage_live`` while a run goes: :func:`damage_shared_pack`).

Owns choosing the newest published snapshot of a local store and damaging it one
:class:`Damage` way. The rerun must skip it, say so on the console, and resume from the
one before; a store with a single published snapshot is left alone (:class:`NothingToDamage`),
since a run whose only snapshot is damaged rightly refuses to start over on its progress.
It reads the store's folders directly (the layout of :mod:`rollpoint.store.snapshot_store`)
and judges nothing: the invariants do.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import orjson

from rollpoint.store.participant_state import MANIFEST_NAME
from rollpoint.store.record_packs import OBJECTS_DIR, is_records_name
from rollpoint.store.snapshot_store import SNAPSHOTS_DIR


class Damage(StrEnum):
    FILE = "file"
    """One byte of a trainer file the manifest names (ledger, the finished queue) flipped: its digest fails."""
    FIELD = "field"
    """The manifest's train step changed by one: its seal fails."""
    MANIFEST = "manifest"
    """The manifest removed: the folder is no published snapshot any more."""


class NothingToDamage(Exception):
    """The store holds no snapshot the fault may damage; the message says why."""


def damage_newest(store: Path, how: Damage) -> str:
    """Damage the newest published snapshot in ``store``; say what was done."""
    published: list[tuple[float, str, dict[str, object]]] = []
    for manifest in sorted((store / SNAPSHOTS_DIR).glob(f"*/{MANIFEST_NAME}")):
        try:
            doc = orjson.loads(manifest.read_bytes())
        except orjson.JSONDecodeError:
            continue  # already unreadable: not one a rerun could use
        published.append((float(doc.get("published_at", 0.0)), manifest.parent.name, doc))
    if len(published) < 2:
        raise NothingToDamage(
            f"{len(published)} published snapshot(s) in {store}: damaging the only one would "
            "leave the rerun nothing to resume from"
        )
    _, snapshot_id, doc = max(published, key=lambda p: (p[0], p[1]))
    folder = store / SNAPSHOTS_DIR / snapshot_id
    if how is Damage.MANIFEST:
        (folder / MANIFEST_NAME).unlink()
        return f"snapshot {snapshot_id}: {MANIFEST_NAME} removed"
    if how is Damage.FIELD:
        step = doc["train_step"]
        assert isinstance(step, int)
        doc["train_step"] = step + 1
        (folder / MANIFEST_NAME).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        return f"snapshot {snapshot_id}: train_step {step} changed to {step + 1}"
    files = doc.get("files")
    assert isinstance(files, dict) and files, f"snapshot {snapshot_id} names no trainer file"
    name = sorted(files)[0]
    entry = files[name]
    assert isinstance(entry, dict)
    path = folder / str(entry["path"])
    data = bytearray(path.read_bytes())
    at = len(data) // 2
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    return f"snapshot {snapshot_id}: byte {at} of {entry['path']} flipped"


def damage_shared_pack(store: Path, how: str) -> str:
    """Damage the records file of ``store``'s ``objects/`` that the most published
    snapshots name (``flip``: one byte in its middle; ``truncate``: cut to half;
    ``delete``: removed); say what was done. Which snapshots name a file is read from
    their folders' bytes (every manifest naming a shared part spells the file's name)."""
    named: dict[str, int] = {}
    folders = [m.parent for m in (store / SNAPSHOTS_DIR).glob(f"*/{MANIFEST_NAME}")]
    if len(folders) < 2:
        raise NothingToDamage(
            f"{len(folders)} published snapshot(s) in {store}: no records file is shared yet"
        )
    packs = sorted(p for p in (store / OBJECTS_DIR).glob("*") if is_records_name(p.name))
    for folder in folders:
        text = b"".join(f.read_bytes() for f in folder.rglob("*") if f.is_file())
        for pack in packs:
            if pack.name.encode() in text:
                named[pack.name] = named.get(pack.name, 0) + 1
    if not named:
        raise NothingToDamage(f"no snapshot in {store} names a shared records file")
    name = max(sorted(named), key=lambda n: named[n])
    path = store / OBJECTS_DIR / name
    if how == "delete":
        path.unlink()
        return f"{name} (named by {named[name]} snapshots) deleted"
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
        return f"{name} (named by {named[name]} snapshots) cut to {len(data) // 2} bytes"
    at = len(data) // 2
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    return f"{name} (named by {named[name]} snapshots): byte {at} flipped"
