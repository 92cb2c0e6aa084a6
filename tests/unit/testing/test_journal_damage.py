"""Each way the chaos harness damages a journal is one the journal notices on open: cut
with a warning naming the file, nothing after the damage trusted, the records before it
kept; a journal it cannot damage that way is left alone."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rollpoint.store.journal import Journal
from rollpoint.testing.journal_damage import (
    JournalDamage,
    NothingToDamage,
    damage_journal,
    newest_journal,
)


def files(root: Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_size) for p in root.rglob("*") if p.is_file())


async def write(store: Path, instance: str, records: int, *, cuts: int = 0) -> list[str]:
    """A model journal of ``records`` records, its active segment closed ``cuts`` times
    along the way (as snapshot cuts close it); the keys in order."""
    journal = Journal.open(str(store / "journal" / "model" / instance))
    keys = []
    for i in range(records):
        if cuts and i and i % (records // (cuts + 1)) == 0:
            journal.checkpoint()
            if journal._rotating is not None:
                await journal._rotating
        keys.append(f"model|r{i}|a0|t0|c0")
        await journal.append_json(keys[-1], "policy_call", {"i": i})
    await journal.close()
    return keys


@pytest.mark.parametrize(
    ("how", "said", "kept"),
    [
        (JournalDamage.TORN_TAIL, "a record torn at offset", 6),  # nothing acknowledged lost
        (JournalDamage.CORRUPT_RECORD, "record checksum mismatch", 5),  # the last one goes
        (JournalDamage.LOST_SEGMENT, "segment missing (lost)", 2),  # it and all after it go
    ],
)
async def test_each_damage_is_cut_on_open_with_a_warning_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: JournalDamage, said: str, kept: int
) -> None:
    await write(tmp_path, "model-replica-0", 4)
    keys = await write(tmp_path, "model-replica-1", 6, cuts=2)  # written last: the one damaged
    assert newest_journal(tmp_path, "model").name == "model-replica-1"

    done = damage_journal(tmp_path, how, "model")

    damaged = done.split()[1].rstrip(":")
    assert "model-replica-1" in damaged
    with caplog.at_level(logging.WARNING, logger="rollpoint.store.journal"):
        journal = Journal.open(str(tmp_path / "journal" / "model" / "model-replica-1"))
    warning = [r.getMessage() for r in caplog.records]
    assert len(warning) == 1 and f"journal {damaged}" in warning[0], warning
    assert said in warning[0] or said in done
    assert [r.key for r in journal.records_after()] == keys[:kept]
    await journal.close()
    untouched = Journal.open(str(tmp_path / "journal" / "model" / "model-replica-0"))
    assert len(list(untouched.records_after())) == 4
    await untouched.close()


async def test_a_journal_it_cannot_damage_that_way_is_left_alone(tmp_path: Path) -> None:
    with pytest.raises(NothingToDamage, match="no agent journal"):
        damage_journal(tmp_path, JournalDamage.TORN_TAIL, "agent")
    await write(tmp_path, "model-replica-0", 4, cuts=1)  # two segments: none between two
    before = files(tmp_path)
    with pytest.raises(NothingToDamage, match="2 segment"):
        damage_journal(tmp_path, JournalDamage.LOST_SEGMENT, "model")
    assert files(tmp_path) == before
