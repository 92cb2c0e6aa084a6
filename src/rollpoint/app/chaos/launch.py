"""A trial process from the runner's side.

Owns starting ``python -m rollpoint.app.chaos.trial`` for a plan, in a session of its own
(its servers join its process group, so one signal reaches them all: :func:`start_trial`),
the run while it goes (:class:`LiveRun`: the process, its record, whether its servers are
up), reading the :class:`~rollpoint.app.chaos.plan.TrialEvent` lines it prints into that
record (:func:`read_events`), and ending its whole group: SIGKILL (:func:`kill_group`),
then waiting until no process of it is left (:func:`wait_group_gone`).

It does not decide when to kill, nor what a run's events mean (the runner in
:mod:`rollpoint.app.chaos.command` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import orjson
from pydantic import ValidationError

from rollpoint.app.chaos.plan import TrialEvent, TrialPlan
from rollpoint.app.chaos.tally import RunRecord

__all__ = ["GONE_WAIT_S", "LiveRun", "kill_group", "read_events", "start_trial", "wait_group_gone"]

GONE_WAIT_S = 5.0


@dataclass
class LiveRun:
    """A trial process while it runs."""

    process: asyncio.subprocess.Process
    record: RunRecord
    up: asyncio.Event = field(default_factory=asyncio.Event)


async def start_trial(
    plan: TrialPlan, *, stdout: int, stderr: int | IO[bytes]
) -> asyncio.subprocess.Process:
    """One trial process for ``plan``, in a session of its own (its servers join its group)."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rollpoint.app.chaos.trial",
        plan.model_dump_json(),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        env={**os.environ, "NO_COLOR": "1"},
    )


async def read_events(live: LiveRun, events_file: Path) -> None:
    """Collect the trial's event lines (and keep them beside its workdir)."""
    assert live.process.stdout is not None
    with events_file.open("ab") as keep:
        while raw := await live.process.stdout.readline():
            try:
                event = TrialEvent.model_validate_json(raw)
            except ValidationError:
                continue  # a line torn by the kill
            line = {"run": live.record.run} | event.model_dump(mode="json", exclude_defaults=True)
            keep.write(orjson.dumps(line) + b"\n")
            live.record.events.append(event)
            if event.event == "up":
                live.up.set()


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def wait_group_gone(pgid: int) -> None:
    """Until no process of group ``pgid`` is left (Linux: /proc), so the next run never
    meets the last one's servers still writing."""
    deadline = time.monotonic() + GONE_WAIT_S
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _group_members(pgid: int) -> list[int]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces or parentheses: fields start after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found
