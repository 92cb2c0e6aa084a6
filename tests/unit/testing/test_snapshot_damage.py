"""Each way the chaos harness damages a snapshot is one the store refuses, falling back to
the snapshot before; a store with one snapshot is left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.testing.snapshot_damage import Damage, NothingToDamage, damage_newest
from tests.unit.trainer.in_process_rig import build_rig


async def published(root: Path, count: int) -> list[str]:
    rig = build_rig(root)
    try:
        rig.dispatch()
        ids = []
        for _ in range(count):
            report = await rig.coordinator().save()
            assert report.published, report.blocked_by
            ids.append(report.snapshot_id)
        return ids
    finally:
        await rig.aclose()


@pytest.mark.parametrize("how", list(Damage))
async def test_the_newest_snapshot_damaged_is_refused_and_the_one_before_is_latest(
    tmp_path: Path, how: Damage
) -> None:
    older, newest = await published(tmp_path / "store", 2)
    assert SnapshotStore(str(tmp_path / "store")).latest().snapshot_id == newest  # type: ignore[union-attr]

    said = damage_newest(tmp_path / "store", how)

    assert said.startswith(f"snapshot {newest}: ")
    latest = SnapshotStore(str(tmp_path / "store"), clean_leftovers=False).latest()
    assert latest is not None and latest.snapshot_id == older


async def test_a_store_with_one_snapshot_is_left_as_it_is(tmp_path: Path) -> None:
    assert len(await published(tmp_path / "store", 1)) == 1
    before = {p: p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file()}

    with pytest.raises(NothingToDamage, match="1 published snapshot"):
        damage_newest(tmp_path / "store", Damage.FILE)

    assert {p: p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file()} == before
