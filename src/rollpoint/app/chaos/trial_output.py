"""What a chaos trial process says, and where.

Owns the trial's three outputs: its events as
:class:`~rollpoint.app.chaos.plan.TrialEvent` JSON lines on stdout (:func:`emit`, flushed
one by one so a runner that SIGKILLs the process keeps every line printed before the
kill), its messages on stderr (:func:`say`, which also turns the job's "resumed from
snapshot" line into a ``resumed`` event: the trial's episode tally), and its log file,
``<workdir>/rollpoint.log`` (:func:`setup_logging`).

It does not decide what to say: the trial (:mod:`rollpoint.app.chaos.trial`) and its
faults (:mod:`rollpoint.app.chaos.trial_faults`) do.
"""

from __future__ import annotations

import logging
import re
import sys
import time

from rollpoint.app.chaos.plan import TrialEvent
from rollpoint.app.config import RunConfig

__all__ = ["emit", "say", "setup_logging"]

# What rollpoint.job.run says after a restore; the numbers are the trial's episode tally.
_RESUMED = re.compile(
    r"resumed from snapshot (?P<snapshot>\S+) at train step \d+: "
    r"(?P<continued>\d+) episodes continued, (?P<restarted>\d+) restarted"
)


def emit(event: TrialEvent) -> None:
    sys.stdout.write(event.model_dump_json(exclude_defaults=True) + "\n")
    sys.stdout.flush()


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    found = _RESUMED.search(message)
    if found:
        emit(
            TrialEvent(
                event="resumed",
                ts=time.time(),
                snapshot_id=found["snapshot"],
                continued=int(found["continued"]),
                restarted=int(found["restarted"]),
            )
        )


def setup_logging(config: RunConfig) -> None:
    handler = logging.FileHandler(config.workdir / "rollpoint.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
