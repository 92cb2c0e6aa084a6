"""A journal shipped to S3 (moto's S3 server on loopback): closed segments put on each ship,
fetched back into an empty folder on a "new machine", read back whole; the records appended
after the last ship are what that machine loses (the documented recovery point)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollpoint.store.journal import Journal
from rollpoint.store.journal_shipping import SegmentShipper, fetch_segments

moto_server = pytest.importorskip("moto.server", reason="moto[server] is a dev dependency")
s3fs = pytest.importorskip("s3fs", reason="s3fs is the s3 extra")

BUCKET = "rollpoint-journal-test"
URL = f"s3://{BUCKET}/run-1/journal/model-0"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for name, value in {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "rollpoint",
        "AWS_SECRET_ACCESS_KEY": "rollpoint",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    if fs.exists(BUCKET):
        fs.rm(BUCKET, recursive=True)
    fs.mkdir(BUCKET)
    # fsspec caches filesystem instances: the shipper must see this server's settings.
    s3fs.S3FileSystem.clear_instance_cache()
    yield fs
    server.stop()


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
