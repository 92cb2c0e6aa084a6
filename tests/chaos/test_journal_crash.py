"""A real journal writer SIGKILLed mid-append at random moments, again and again on one folder.

Every append the writer acknowledged (its ``ACK`` line reached us before the kill) must be
read back whole after the kill, and every record read back must be a whole one (its
payload is the one its key determines): nothing half-written is trusted. The kills land at
seeded random moments while 64 appenders write records of up to 64 KiB, so they fall inside
group commits, segment rotations and the open that follows a previous kill.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollpoint.store.journal import Journal
from tests.support.journal_writer import payload_for

pytestmark = pytest.mark.chaos

TRIALS = 12
ROOT = Path(__file__).resolve().parents[2]


def _run_and_kill(folder: Path, seed: int, delay_s: float) -> list[str]:
    """Start a writer, SIGKILL it ``delay_s`` after it is ready; the keys it acknowledged."""
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.support.journal_writer", str(folder), str(seed)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    assert writer.stdout is not None
    lines: list[bytes] = []
    ready = threading.Event()

    def read() -> None:
        assert writer.stdout is not None
        for line in writer.stdout:
            if line == b"READY\n":
                ready.set()
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(60), "the writer never opened its journal"
        time.sleep(delay_s)  # the random moment of the kill; the assertions hold for any
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(30)
        reader.join(30)
    # Only whole lines: a line cut by the kill was not an acknowledgement we received.
    return [
        line[4:-1].decode() for line in lines if line.startswith(b"ACK ") and line.endswith(b"\n")
    ]


@pytest.mark.timeout(600)
async def test_every_acknowledged_append_survives_a_sigkill_and_nothing_half_written_is_read(
    tmp_path: Path,
) -> None:
    rng = random.Random(35)
    folder = tmp_path / "journal"
    acknowledged: set[str] = set()
    for trial in range(TRIALS):
        acked = _run_and_kill(folder, seed=trial, delay_s=rng.uniform(0.0, 0.4))
        acknowledged.update(acked)
        journal = Journal.open(str(folder))
        try:
            seen = set()
            for record in journal.records_after():
                assert record.payload == payload_for(record.key), f"half-written {record.key}"
                seen.add(record.key)
            missing = acknowledged - seen
            assert not missing, f"trial {trial}: {len(missing)} acknowledged appends lost"
            for key in acked[-5:]:
                found = journal.lookup(key)
                assert found is not None and found.payload == payload_for(key)
        finally:
            await journal.close()
    assert len(acknowledged) > TRIALS * 10, "the kills came before the writer appended anything"
