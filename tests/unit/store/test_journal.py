"""The journal: group commit (fsyncs counted through the seam), look-ups by key, positions,
cutting a torn or corrupt tail on open, retention."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollpoint.protocol.errors import JournalFormatError, StorageError
from rollpoint.store import journal as journal_module
from rollpoint.store.journal import Journal, Position
from rollpoint.store.journal_format import HEADER, SegmentHeader, encode_header, segment_name


class CountingFsync:
    """The fsync seam: counts calls and really fsyncs; ``hold()`` makes the next call wait."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def hold(self) -> None:
        self.entered.clear()
        self.release.clear()

    def __call__(self, fd: int) -> None:
        self.calls += 1
        self.entered.set()
        self.release.wait()
        os.fsync(fd)


def _open(folder: Path, fsync: Callable[[int], None] = os.fsync, **kw: object) -> Journal:
    return Journal.open(str(folder), fsync=fsync, **kw)  # type: ignore[arg-type]


async def test_a_thousand_concurrent_appends_share_one_fsync(tmp_path: Path) -> None:
    fsync = CountingFsync()
    journal = _open(tmp_path / "j", fsync, window_s=0.0)
    opened = fsync.calls  # the first segment's header and folder entry
    positions = await asyncio.gather(
        *(journal.append(f"k{i}", "policy_call", b"x" * 100) for i in range(1000))
    )
    assert fsync.calls - opened == 1
    assert journal.metrics.records == 1000 and journal.metrics.commits == 1
    assert positions == sorted(positions) and positions[-1] == journal.position
    await journal.close()


async def test_appends_made_during_a_commit_wait_for_it_and_share_the_next(tmp_path: Path) -> None:
    fsync = CountingFsync()
    journal = _open(tmp_path / "j", fsync, window_s=0.0)
    opened = fsync.calls
    fsync.hold()
    first = asyncio.create_task(journal.append("first", "turn", b"1"))
    await asyncio.to_thread(fsync.entered.wait, 10)
    later = [asyncio.create_task(journal.append(f"k{i}", "turn", b"2")) for i in range(500)]
    await asyncio.sleep(0)
    assert not first.done(), "an append returned before its fsync"
    assert journal.lookup("first") is None, "a record not yet durable is answered"
    fsync.release.set()
    await first
    await asyncio.gather(*later)
    assert fsync.calls - opened == 2
    assert journal.metrics.commits == 2 and journal.metrics.records_per_fsync > 100
    await journal.close()


async def test_lookup_answers_the_last_record_of_a_key_before_and_after_reopening(
    tmp_path: Path,
) -> None:
    journal = _open(tmp_path / "j")
    await journal.append_json("rollout-1|a0|t0|c0", "effect_intent", {"to": "x"})
    await journal.append_json("rollout-1|a0|t0|c1", "policy_call", {"tokens": [1, 2]})
    await journal.append_json("rollout-1|a0|t0|c0", "effect_result", {"ok": True})
    assert journal.lookup("missing") is None
    for j in (journal, reopened := _open(tmp_path / "j")):
        record = j.lookup("rollout-1|a0|t0|c0")
        assert record is not None and record.kind == "effect_result"
        assert record.value() == {"ok": True}
        assert j.lookup("rollout-1|a0|t0|c1").value() == {"tokens": [1, 2]}  # type: ignore[union-attr]
    await journal.close()
    await reopened.close()


async def test_opening_says_how_long_it_read_back_what_was_journaled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``read_back_s``: the scan of earlier segments (the servers report it as
    ``journal_read_ms``, the restore records it, the report shows it)."""
    journal = _open(tmp_path / "j")
    await journal.append_json("rollout-1|a0|t0|c0", "policy_call", {"tokens": [1, 2]})
    await journal.close()
    real_scan = journal_module.scan

    def slow_scan(*args: object, **kw: object) -> object:
        time.sleep(0.2)
        return real_scan(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(journal_module, "scan", slow_scan)
    reopened = _open(tmp_path / "j")
    assert reopened.read_back_s >= 0.2 and reopened.read_back_ms >= 200
    assert reopened.lookup("rollout-1|a0|t0|c0") is not None
    await reopened.close()


async def test_records_after_a_position_are_exactly_the_later_ones(tmp_path: Path) -> None:
    journal = _open(tmp_path / "j", segment_bytes=300)
    ends = [await journal.append(f"k{i}", "turn", b"y" * 60) for i in range(12)]
    assert len({e.segment for e in ends}) > 2, "the test needs several segments"
    assert [r.key for r in journal.records_after()] == [f"k{i}" for i in range(12)]
    for i, end in enumerate(ends):
        assert [r.key for r in journal.records_after(end)] == [f"k{j}" for j in range(i + 1, 12)]
    await journal.close()


async def test_a_torn_tail_is_cut_with_a_warning_naming_file_and_offset(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "j"
    journal = _open(folder)
    ends = [await journal.append(f"k{i}", "turn", b"z" * 50) for i in range(3)]
    await journal.close()
    segment = folder / segment_name(1)
    os.truncate(segment, ends[2].offset - 7)
    with caplog.at_level(logging.WARNING, logger="rollpoint.store.journal"):
        reopened = _open(folder)
    assert f"journal {segment}:" in caplog.text and f"at offset {ends[1].offset}" in caplog.text
    assert reopened.lookup("k2") is None and reopened.lookup("k1") is not None
    await reopened.append("k3", "turn", b"after")
    await reopened.close()
    # The torn bytes are still in segment 1 (nothing truncated); segment 2 says where it ends.
    assert segment.stat().st_size == ends[2].offset - 7
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rollpoint.store.journal"):
        again = _open(folder)
    assert caplog.text == ""
    assert [r.key for r in again.records_after()] == ["k0", "k1", "k3"]
    await again.close()


async def test_damage_in_a_closed_segment_sets_every_later_segment_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "j"
    journal = _open(folder, segment_bytes=200)
    ends = [await journal.append(f"k{i}", "turn", b"w" * 60) for i in range(8)]
    await journal.close()
    damaged = ends[0].segment
    path = folder / segment_name(damaged)
    data = bytearray(path.read_bytes())
    data[ends[0].offset + 10] ^= 0x01  # inside the second record of the first segment
    path.write_bytes(bytes(data))
    later = sorted(p.name for p in folder.iterdir() if p.name > path.name)
    with caplog.at_level(logging.WARNING, logger="rollpoint.store.journal"):
        reopened = _open(folder)
    assert f"journal {path}: record checksum mismatch at offset {ends[0].offset}" in caplog.text
    assert [r.key for r in reopened.records_after()] == ["k0"]
    assert all((folder / f"{name}.untrusted").exists() for name in later)
    assert reopened.lookup("k5") is None
    await reopened.close()


async def test_an_unknown_format_version_is_refused_naming_the_segment(tmp_path: Path) -> None:
    folder = tmp_path / "j"
    folder.mkdir()
    head = bytearray(encode_header(SegmentHeader(segment=1, prev_end=0)))
    head[8] = 99  # the version field, with its checksum left to disagree: re-sealed below
    from crc32c import crc32c

    head[24:28] = crc32c(bytes(head[:24])).to_bytes(4, "little")
    (folder / segment_name(1)).write_bytes(bytes(head))
    with pytest.raises(JournalFormatError, match=r"format version 99") as info:
        _open(folder)
    assert str(folder / segment_name(1)) in str(info.value)


async def test_drop_before_deletes_only_segments_wholly_before_the_position(tmp_path: Path) -> None:
    journal = _open(tmp_path / "j", segment_bytes=200)
    ends = [await journal.append(f"k{i}", "turn", b"v" * 60) for i in range(8)]
    keep = ends[4]
    dropped = journal.drop_before(keep)
    assert dropped == [segment_name(n) for n in range(1, keep.segment)]
    assert [r.key for r in journal.records_after(Position(keep.segment, HEADER))][-1] == "k7"
    assert journal.lookup("k4") is not None
    assert all(journal.lookup(f"k{i}") is None for i in range(8) if ends[i].segment < keep.segment)
    await journal.close()


async def test_metrics_count_records_bytes_and_fsyncs(tmp_path: Path) -> None:
    fsync = CountingFsync()
    journal = _open(tmp_path / "j", fsync, window_s=0.0)
    await asyncio.gather(*(journal.append(f"k{i}", "t", b"p" * 10) for i in range(10)))
    await journal.append("one", "t", b"p")
    m = journal.metrics
    assert (m.records, m.commits) == (11, 2)
    assert m.fsyncs == fsync.calls == 4  # the header and folder at open, two commits
    assert m.records_per_fsync == 11 / 4
    assert m.bytes == sum(r.end.offset - r.start.offset for r in journal.records_after())
    await journal.close()


async def test_a_failed_fsync_fails_the_waiting_appends_and_every_later_one(tmp_path: Path) -> None:
    calls = 0

    def failing(fd: int) -> None:
        nonlocal calls
        calls += 1
        if calls > 2:
            raise OSError(5, "Input/output error")

    journal = _open(tmp_path / "j", failing, window_s=0.0)
    with pytest.raises(StorageError, match="write failed"):
        await journal.append("k", "t", b"x")
    with pytest.raises(StorageError, match="an earlier write failed"):
        await journal.append("k2", "t", b"x")
    await journal.close()


async def test_a_burst_is_committed_in_batches_of_at_most_batch_bytes(tmp_path: Path) -> None:
    journal = _open(tmp_path / "j", window_s=0.0, batch_bytes=10_000)
    ends = await asyncio.gather(*(journal.append(f"k{i:03d}", "t", b"b" * 960) for i in range(100)))
    frame = ends[0].offset - HEADER  # every frame here is the same size
    per_commit = 10_000 // frame
    assert journal.metrics.commits == -(-100 // per_commit)
    assert journal.metrics.records_per_fsync > 1
    await journal.close()


async def test_a_lone_appender_does_not_wait_out_the_window(tmp_path: Path) -> None:
    # A 60 s window: were a lone append made to wait for company, this would time out.
    journal = _open(tmp_path / "j", window_s=60.0)
    for i in range(3):
        await asyncio.wait_for(journal.append(f"k{i}", "t", b"x"), 30)
    assert journal.metrics.commits == 3
    await journal.close()


async def test_under_load_the_window_gathers_appends_that_arrive_apart(tmp_path: Path) -> None:
    journal = _open(tmp_path / "j", window_s=1.0)
    await asyncio.gather(*(journal.append(f"a{i}", "t", b"x") for i in range(2)))  # load seen
    tasks = []
    for i in range(6):  # each in its own loop iteration: no two are ready at the same time
        tasks.append(asyncio.create_task(journal.append(f"b{i}", "t", b"x")))
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert journal.metrics.commits == 2, "appends within the window took more than one commit"
    await journal.close()


async def test_a_segment_of_an_older_version_is_migrated_and_its_original_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from crc32c import crc32c

    from rollpoint.store import journal_format

    folder = tmp_path / "j"
    journal = _open(folder)
    await journal.append("k0", "turn", b"zero")
    await journal.close()
    segment = folder / segment_name(1)
    current = segment.read_bytes()
    old = bytearray(current)
    old[8] = 0  # as if written by a format 0 that differed only in its version
    old[24:28] = crc32c(bytes(old[:24])).to_bytes(4, "little")
    segment.write_bytes(bytes(old))

    def from_0(data: bytes) -> bytes:
        segment = int.from_bytes(data[12:16], "little")
        prev_end = int.from_bytes(data[16:24], "little")
        header = journal_format.SegmentHeader(segment=segment, prev_end=prev_end)
        return journal_format.encode_header(header) + data[HEADER:]

    monkeypatch.setitem(journal_format.MIGRATIONS, 0, from_0)
    with caplog.at_level(logging.WARNING, logger="rollpoint.store.journal"):
        reopened = _open(folder)
    assert f"journal {segment}: migrated from format version 0 to 1" in caplog.text
    assert reopened.lookup("k0").payload == b"zero"  # type: ignore[union-attr]
    assert segment.read_bytes() == current
    assert (folder / f"{segment_name(1)}.v0").read_bytes() == bytes(old)
    await reopened.close()


async def test_close_flushes_what_is_queued_and_refuses_later_appends(tmp_path: Path) -> None:
    journal = _open(tmp_path / "j", window_s=0.5)
    await asyncio.gather(*(journal.append(f"a{i}", "t", b"x") for i in range(2)))
    queued = asyncio.create_task(journal.append("queued", "t", b"x"))
    await asyncio.sleep(0)
    await journal.close()
    assert queued.done() and queued.result().segment == 1
    with pytest.raises(StorageError, match="closed"):
        await journal.append("late", "t", b"x")
    reopened = _open(tmp_path / "j")
    assert reopened.lookup("queued") is not None
    await reopened.close()


async def test_a_segment_left_empty_by_a_crash_while_creating_it_is_set_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "j"
    journal = _open(folder)
    await journal.append("k0", "turn", b"0")
    await journal.close()
    (folder / segment_name(2)).write_bytes(b"")  # created, killed before its header was written
    with caplog.at_level(logging.WARNING, logger="rollpoint.store.journal"):
        reopened = _open(folder)
    assert f"journal {folder / segment_name(2)}: header missing or damaged" in caplog.text
    assert (folder / f"{segment_name(2)}.untrusted").exists()
    await reopened.append("k1", "turn", b"1")
    assert [r.key for r in reopened.records_after()] == ["k0", "k1"]
    await reopened.close()


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(payloads=st.lists(st.binary(min_size=0, max_size=40), min_size=2, max_size=4))
def test_a_journal_torn_at_every_byte_of_its_last_record_reopens_to_the_records_before(
    tmp_path: Path, payloads: list[bytes]
) -> None:
    async def scenario() -> None:
        base = tmp_path / uuid.uuid4().hex
        journal = _open(base / "whole", lambda fd: None)
        ends = [await journal.append(f"k{i}", "turn", p) for i, p in enumerate(payloads)]
        await journal.close()
        whole = (base / "whole" / segment_name(1)).read_bytes()
        last_start = ends[-2].offset
        for cut in range(last_start + 1, ends[-1].offset):
            folder = base / f"cut-{cut}"
            folder.mkdir()
            (folder / segment_name(1)).write_bytes(whole[:cut])
            torn = _open(folder, lambda fd: None)
            kept = [(r.key, r.payload) for r in torn.records_after()]
            assert kept == [(f"k{i}", p) for i, p in enumerate(payloads[:-1])], cut
            assert torn.lookup(f"k{len(payloads) - 1}") is None
            await torn.append("after", "turn", b"a")
            await torn.close()
            again = _open(folder, lambda fd: None)
            assert [r.key for r in again.records_after()][-1] == "after"
            await again.close()

    asyncio.run(scenario())


async def test_under_a_store_root_the_journal_goes_through_the_contained_filesystem(
    tmp_path: Path,
) -> None:
    from rollpoint.protocol.errors import BadRequestError
    from rollpoint.store.contained_filesystem import ContainedFilesystem

    root = tmp_path / "store"
    fs = ContainedFilesystem(str(root))
    journal = Journal.open(str(root / "journal" / "model" / "model-0"), fs=fs)
    await journal.append("k", "policy_call", b"x")
    await journal.close()
    assert (root / "journal" / "model" / "model-0" / segment_name(1)).exists()
    (tmp_path / "elsewhere").mkdir()
    (root / "journal" / "agent").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BadRequestError, match="symlink"):
        Journal.open(str(root / "journal" / "agent" / "agent-0"), fs=fs)
    assert list((tmp_path / "elsewhere").iterdir()) == []


async def test_append_soon_returns_before_its_fsync_and_is_durable_before_a_later_append(
    tmp_path: Path,
) -> None:
    fsync = CountingFsync()
    journal = _open(tmp_path / "j", fsync, window_s=0.0, batch_bytes=1)  # a commit a record
    fsync.hold()
    queued = journal.append_soon("turn", "turn", b"1")
    await asyncio.to_thread(fsync.entered.wait, 10)
    assert not queued.done(), "append_soon waited for, or skipped, its fsync"
    later = asyncio.create_task(journal.append("reply", "reply", b"2"))
    fsync.release.set()
    end = await later
    assert queued.done() and queued.result() < end, "a later record was durable first"
    assert journal.metrics.commits == 2
    await journal.close()


async def test_a_lost_segment_between_two_cuts_the_journal_where_it_was(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Segments are numbered without gaps: one missing between two is lost, and the
    segments after it are not trusted (their records follow records that are gone)."""
    folder = tmp_path / "j"
    journal = _open(folder, segment_bytes=200)
    ends = [await journal.append(f"k{i}", "turn", b"w" * 60) for i in range(8)]
    await journal.close()
    numbers = sorted({e.segment for e in ends})
    assert len(numbers) >= 3, ends
    lost = folder / segment_name(numbers[1])
    lost.unlink()
    before = [e for e in ends if e.segment == numbers[0]]
    later = sorted(p.name for p in folder.iterdir() if p.name > lost.name)
    with caplog.at_level(logging.WARNING, logger="rollpoint.store.journal"):
        reopened = _open(folder)
    assert f"journal {lost}: segment missing (lost)" in caplog.text
    kept = [f"k{i}" for i in range(len(before))]
    assert [r.key for r in reopened.records_after()] == kept
    assert all((folder / f"{name}.untrusted").exists() for name in later)
    assert reopened.lookup(f"k{len(before)}") is None and reopened.lookup("k7") is None
    await reopened.append("after", "turn", b"x")
    await reopened.close()

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rollpoint.store.journal"):
        again = _open(folder)  # the cut's new segment took the lost one's number: no gap
    assert "missing" not in caplog.text and "cut there" not in caplog.text
    assert [r.key for r in again.records_after()] == [*kept, "after"]
    await again.close()
