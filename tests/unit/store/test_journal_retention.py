"""Journal retention: the segments no published snapshot's mark needs are deleted, nothing
else; a live journal forgets what was deleted (its index is pruned) and closes its active
segment at each cut so the next cut's records start a new one."""

from __future__ import annotations

from pathlib import Path

from rollpoint.protocol.manifest import JournalMark
from rollpoint.store.contained_filesystem import ContainedFilesystem
from rollpoint.store.journal import Journal
from rollpoint.store.journal_format import segment_name
from rollpoint.store.journal_retention import JournalRetention
from rollpoint.store.participant_state import write_participant_state

FOLDER = "journal/model/model-replica-0"


def snapshot(
    root: Path, sid: str, mark: JournalMark | None, instance: str = "model-replica-0"
) -> None:
    """A published snapshot whose model participant saved ``mark``."""
    folder = root / "snapshots" / sid / "participants" / "model" / instance
    write_participant_state(
        str(folder),
        kind="model",
        instance=instance,
        checkpoint_id=f"c-{sid}",
        records=[{"a": 1}],
        root=str(root),
        journal=mark,
    )


async def journal_with_segments(root: Path, n: int) -> tuple[Journal, list[JournalMark]]:
    """A journal whose cuts closed ``n`` segments, one record each; the mark of each cut."""
    journal = Journal.open(str(root / FOLDER))
    marks = []
    for i in range(n):
        await journal.append_json(f"model|r{i}|a0|t0|c0", "policy_call", {"i": i})
        position = journal.checkpoint()
        marks.append(JournalMark(folder=FOLDER, segment=position.segment, offset=position.offset))
        if journal._rotating is not None:
            await journal._rotating  # the segment closed before the next record
    return journal, marks


def segments(root: Path, folder: str = FOLDER) -> list[str]:
    return sorted(p.name for p in (root / folder).iterdir())


def retention(root: Path) -> JournalRetention:
    return JournalRetention(ContainedFilesystem(str(root)), str(root))


async def test_segments_before_the_oldest_mark_of_the_snapshots_left_are_deleted(
    tmp_path: Path,
) -> None:
    journal, marks = await journal_with_segments(tmp_path, 4)
    assert [m.segment for m in marks] == [1, 2, 3, 4]  # each cut closed its segment
    snapshot(tmp_path, "s2", marks[1])
    snapshot(tmp_path, "s3", marks[2])
    (tmp_path / FOLDER / "segment-0000000001.rpj.untrusted").write_bytes(b"set aside")
    (tmp_path / FOLDER / "notes.txt").write_bytes(b"not ours")

    removed = retention(tmp_path).sweep(str(tmp_path / "snapshots"), ["s2", "s3"])

    assert removed == [f"{FOLDER}/{segment_name(1)}"]
    assert segment_name(1) not in segments(tmp_path)
    assert {"segment-0000000001.rpj.untrusted", "notes.txt"} <= set(segments(tmp_path))
    # The live journal forgets the deleted segment: its keys leave the index, the rest answer.
    assert "model|r0|a0|t0|c0" in journal
    assert journal.forget_removed() == [1]
    assert "model|r0|a0|t0|c0" not in journal and journal.lookup("model|r0|a0|t0|c0") is None
    rec = journal.lookup("model|r1|a0|t0|c0")
    assert rec is not None and rec.value() == {"i": 1}
    assert next(r.key for r in journal.records_after()) == "model|r1|a0|t0|c0"
    await journal.close()


async def test_a_snapshot_without_a_mark_keeps_the_whole_journal(tmp_path: Path) -> None:
    journal, marks = await journal_with_segments(tmp_path, 3)
    before = segments(tmp_path)
    snapshot(tmp_path, "old", None)  # taken before the participant journaled
    snapshot(tmp_path, "new", marks[2])

    assert retention(tmp_path).sweep(str(tmp_path / "snapshots"), ["old", "new"]) == []
    assert segments(tmp_path) == before
    await journal.close()


async def test_a_folder_no_snapshot_names_is_left_alone(tmp_path: Path) -> None:
    journal, marks = await journal_with_segments(tmp_path, 3)
    other = "journal/model/model-replica-1"
    (tmp_path / other).mkdir(parents=True)
    (tmp_path / other / segment_name(1)).write_bytes(b"x")
    snapshot(tmp_path, "s", marks[2])

    removed = retention(tmp_path).sweep(str(tmp_path / "snapshots"), ["s"])

    assert sorted(removed) == [f"{FOLDER}/{segment_name(1)}", f"{FOLDER}/{segment_name(2)}"]
    assert segments(tmp_path, other) == [segment_name(1)]
    await journal.close()


async def test_a_lookup_in_a_segment_deleted_under_it_is_a_miss_not_an_error(
    tmp_path: Path,
) -> None:
    journal, marks = await journal_with_segments(tmp_path, 2)
    snapshot(tmp_path, "s", marks[1])
    retention(tmp_path).sweep(str(tmp_path / "snapshots"), ["s"])
    assert journal.lookup("model|r0|a0|t0|c0") is None
    assert "model|r0|a0|t0|c0" not in journal
    await journal.close()
