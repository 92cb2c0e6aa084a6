"""A journal shipped to S3 (moto's S3 server on loopback): closed segments put on each ship,
fetched back into an empty folder on a "new machine", read back whole; the records appended
after the last ship are what that machine loses (the documented recovery point)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollpoint.store.journal import Journal
from rollpoint.store.journal_shipping import (
    SPOOL_ENV,
    SegmentShipper,
    fetch_segments,
    open_store_journal,
)
from tests.support.moto_s3 import moto_s3

BUCKET = "rollpoint-journal-test"
URL = f"s3://{BUCKET}/run-1/journal/model-0"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    with moto_s3(monkeypatch, BUCKET) as fs:
        yield fs


async def test_shipped_segments_restore_on_a_new_machine_up_to_the_last_ship(
    s3: Any, tmp_path: Path
) -> None:
    journal = Journal.open(str(tmp_path / "spool"))
    shipper = SegmentShipper(journal, URL, every_s=60)
    for i in range(5):
        await journal.append_json(f"k{i}", "policy_call", {"i": i})
    shipped = await shipper.ship_once()
    assert shipped == ["segment-0000000001.rpj"]
    assert await shipper.ship_once() == [], "an empty active segment is not shipped"
    await journal.append_json("after-ship", "policy_call", {"i": 5})
    await journal.close()

    new_machine = tmp_path / "new-machine"
    assert fetch_segments(URL, str(new_machine)) == ["segment-0000000001.rpj"]
    restored = Journal.open(str(new_machine))
    assert [r.key for r in restored.records_after()] == [f"k{i}" for i in range(5)]
    assert restored.lookup("k3").value() == {"i": 3}  # type: ignore[union-attr]
    assert (
        restored.lookup("after-ship") is None
    )  # appended after the last ship: lost with the machine
    await restored.close()
    assert shipper.metrics.segments == 1 and shipper.metrics.bytes > 0


async def test_a_restart_on_the_same_machine_ships_what_the_last_process_left(
    s3: Any, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    journal = Journal.open(str(spool))
    await journal.append("k0", "turn", b"0")
    await journal.close()  # killed before any ship
    reopened = Journal.open(str(spool))
    shipper = SegmentShipper(reopened, URL, every_s=60)
    await reopened.append("k1", "turn", b"1")
    assert await shipper.ship_once() == ["segment-0000000001.rpj", "segment-0000000002.rpj"]
    assert sorted(p.rsplit("/", 1)[-1] for p in s3.ls(URL)) == [
        "segment-0000000001.rpj",
        "segment-0000000002.rpj",
    ]
    shipper.forget(reopened.drop_before(reopened.position))
    s3.invalidate_cache()
    assert [p for p in s3.find(URL) if p.endswith(".rpj")] == []
    await reopened.close()


async def test_segments_rewritten_after_a_cut_replace_their_shipped_namesakes(
    s3: Any, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    journal = Journal.open(str(spool))
    shipper = SegmentShipper(journal, URL, every_s=60)
    await journal.append("k0", "turn", b"0" * 50)
    await shipper.ship_once()
    await journal.append("k1", "turn", b"1" * 50)
    await shipper.ship_once()  # segments 1 and 2 are at the URL
    await journal.close()
    first = spool / "segment-0000000001.rpj"
    damaged = bytearray(first.read_bytes())
    damaged[-3] ^= 0x01  # k0's record: the cut is at segment 1's first record
    first.write_bytes(bytes(damaged))
    reopened = Journal.open(str(spool))  # sets 2 and 3 aside, writes a new segment 2
    await reopened.append("k9", "turn", b"9")
    shipper = SegmentShipper(reopened, URL, every_s=60)
    assert await shipper.ship_once() == ["segment-0000000002.rpj"]
    await reopened.close()

    new_machine = tmp_path / "new-machine"
    fetch_segments(URL, str(new_machine))
    restored = Journal.open(str(new_machine))
    # Segment 1 as shipped is whole, but the new segment 2 says it ends at its first record,
    # where the writer cut it: what the writer set aside is not trusted anywhere.
    assert [r.key for r in restored.records_after()] == ["k9"]
    await restored.close()


async def test_a_segment_retention_deleted_at_the_url_leaves_the_spool_too(
    s3: Any, tmp_path: Path
) -> None:
    """The trainer's retention deletes shipped segments no kept snapshot needs at the URL;
    the next ship deletes their spool copies, and the journal forgets them at its next
    checkpoint: a long run's spool stays as small as the store's journal."""
    spool = tmp_path / "spool"
    journal = Journal.open(str(spool))
    shipper = SegmentShipper(journal, URL, every_s=60)
    for i in range(3):
        await journal.append_json(f"k{i}", "policy_call", {"i": i})
        await shipper.ship_once()  # one segment each
    names = sorted(p.name for p in spool.glob("segment-*.rpj"))
    assert len(names) == 4  # three closed, shipped; the active one
    s3.rm(f"{URL}/{names[0]}")  # retention's delete

    await shipper.ship_once()

    assert not (spool / names[0]).exists()
    assert (spool / names[1]).exists() and (spool / names[2]).exists()
    assert journal.forget_removed() == [1]
    assert journal.lookup("k0") is None and journal.lookup("k1") is not None
    await journal.close()


async def test_a_store_journal_is_spooled_shipped_and_fetched_on_a_new_machine(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journaling servers' one way in (open_store_journal): for an fsspec store the
    journal is this machine's spool, shipped while open and once more when closed; a new
    machine (another spool) starts with what was shipped."""
    root = f"s3://{BUCKET}/run-2"
    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "machine-1"))
    journal, shipping = await open_store_journal(root, "journal/model/m-0", window_s=0.002)
    assert shipping is not None and journal.folder.startswith(str(tmp_path / "machine-1"))
    await journal.append_json("k0", "policy_call", {"i": 0})
    await shipping.aclose()
    await journal.close()
    assert s3.ls(f"{root}/journal/model/m-0")

    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "machine-2"))
    again, shipping = await open_store_journal(root, "journal/model/m-0", window_s=0.002)
    assert shipping is not None
    found = again.lookup("k0")
    assert found is not None and found.value() == {"i": 0}
    await shipping.aclose()
    await again.close()


async def test_a_local_store_journal_is_the_folder_itself(tmp_path: Path) -> None:
    journal, shipping = await open_store_journal(str(tmp_path), "journal/agent/a-0", window_s=0)
    assert shipping is None and journal.folder == f"{tmp_path}/journal/agent/a-0"
    await journal.close()
