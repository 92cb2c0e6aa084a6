"""``rollpoint run`` when the run directory itself is touched (issue 15): two reruns at
once, a tampered manifest, a full snapshot disk, an edited or truncated train data file.

Each test drives the real command as a process (``tests/support/run_process.py``), breaks
the workdir the way an operator or a scheduler would, and checks what the rerun did from
the workdir: invariants I1 to I4 when it must resume, the files left untouched when it
must refuse.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.chaos.test_crash_recovery import (
    Start,
    assert_invariants,
    crash,
    start,
    wait_for_resumable_snapshot,
    write_config,
)
from tests.support.run_process import RunProcess

pytestmark = pytest.mark.chaos

__all__ = ["start"]  # the fixture, shared with the crash tests

_BUSY = re.compile(r"workdir \S+ is in use by process (\d+)")


def test_two_reruns_at_once_one_is_refused_before_touching_anything(
    tmp_path: Path, start: Start
) -> None:
    config = write_config(tmp_path)
    workdir = tmp_path / "run"
    run = start(config)
    wait_for_resumable_snapshot(run, workdir)
    crash(run)

    # A scheduler retrying while the old job is torn down: both reruns start together.
    both = [RunProcess(config), RunProcess(config)]
    try:
        finished = [r.finish() for r in both]
    finally:
        for r in both:
            if r.proc.poll() is None:
                r.kill()

    codes = sorted(f.returncode for f in finished)
    assert codes[0] == 0 and codes[1] != 0, [f.stderr[-1500:] for f in finished]
    loser = next(f for f in finished if f.returncode != 0)
    winner = next(r for r, f in zip(both, finished, strict=True) if f.returncode == 0)
    busy = _BUSY.search(loser.stderr)
    assert busy and int(busy.group(1)) == winner.proc.pid, loser.stderr[-1500:]
    assert "Traceback" not in loser.stderr
    assert "servers up" not in loser.stderr and "restoring" not in loser.stderr
    assert_invariants(config, finished[both.index(winner)])
