"""Failed prompt groups: how many a run may have, how they read, and sending them again.

Owns :class:`FailureLimit` (``failure.max_failed_fraction``: once enough groups are
settled, more than that share failed stops the run), :func:`digest` (how many groups failed
and the most common reasons, in one line: the last line ``rollpoint run`` prints) and the
retry of a resumed run's failed groups (:func:`retry_failed`): each failed group's task is
added again as a new group, ``<task_id>-g<n>`` (the first is ``-g0``), sent like any other;
what was trained stays trained. A failed group whose task has a newer group is
*superseded* (:func:`superseded`): the ledger itself says so, so a run restored after the
retry knows it without a record of its own.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping

from rollpoint.trainer.state.finished_queue import FinishedQueue
from rollpoint.trainer.state.ledger import RecoveryLedger

REASONS_SHOWN = 3
REASON_CHARS = 160

_ROW_PREFIX = re.compile(r"^row \d+ \([^)]*\): ")
_ROLLOUT_ID = re.compile(r"\br[0-9a-f]{16}(#\d+)?\b")
_URL = re.compile(r"https?://[^\s/]+")


class FailureLimit:
    """Counts groups as they settle; :attr:`exceeded` once more than ``max_fraction`` of at
    least ``min_groups`` settled ones failed (or of every group, in a smaller run)."""

    def __init__(self, max_fraction: float, min_groups: int) -> None:
        self.max_fraction = max_fraction
        self.min_groups = min_groups
        self.failed = 0
        self.settled = 0

    def settle(self, *, failed: bool) -> None:
        self.settled += 1
        self.failed += failed

    def exceeded(self, groups_total: int) -> bool:
        if self.max_fraction >= 1.0 or self.settled < min(self.min_groups, groups_total):
            return False
        return self.failed > self.max_fraction * self.settled

    def line(self) -> str:
        return (
            f"{self.failed} of the {self.settled} groups settled so far failed, more than "
            f"failure.max_failed_fraction ({self.max_fraction:g})"
        )


def reason_kind(reason: str) -> str:
    """A reason with what differs from row to row taken out (the row, rollout ids, the
    peer's address), so the same fault in many groups counts as one reason."""
    text = _ROW_PREFIX.sub("", " ".join(reason.split()))
    text = _ROLLOUT_ID.sub("<rollout>", text)
    text = _URL.sub("", text)
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 1] + "…"


def digest(failed: Mapping[str, str]) -> str:
    """``3 groups failed; most common: environment_error: … (2 groups); no result … (1)``."""
    count = len(failed)
    noun = "group" if count == 1 else "groups"
    if not failed:
        return "0 groups failed"
    kinds = Counter(reason_kind(reason) for reason in failed.values())
    shown = "; ".join(
        f"{kind} ({n} {'group' if n == 1 else 'groups'})"
        for kind, n in kinds.most_common(REASONS_SHOWN)
    )
    more = f"; and {len(kinds) - REASONS_SHOWN} other reasons" if len(kinds) > REASONS_SHOWN else ""
    return f"{count} {noun} failed; most common: {shown}{more}"


def superseded(ledger: RecoveryLedger) -> set[str]:
    """Failed groups whose task was sent again as a newer group (retried)."""
    newest: dict[str, str] = {}
    for gid in ledger.group_ids():
        newest[ledger.group(gid).task_id] = gid
    return {gid for gid in ledger.failed_groups() if newest[ledger.group(gid).task_id] != gid}


def retry_failed(ledger: RecoveryLedger, tq: FinishedQueue, group_size: int) -> dict[str, str]:
    """Add every failed group not retried yet again, as a new group of its task; returns
    old group id → new one. The new group is the task's ``-g<n>``, n its groups so far."""
    done = superseded(ledger)
    groups_of: Counter[str] = Counter(ledger.group(gid).task_id for gid in ledger.group_ids())
    retried: dict[str, str] = {}
    for gid in ledger.failed_groups():
        if gid in done:
            continue
        task_id = ledger.group(gid).task_id
        new = f"{task_id}-g{groups_of[task_id]}"
        while ledger.has_group(new):  # a group id given by hand that looks like ours
            groups_of[task_id] += 1
            new = f"{task_id}-g{groups_of[task_id]}"
        groups_of[task_id] += 1
        ledger.add_group(ledger.task(task_id), new, group_size)
        tq.expect_group(new, group_size)
        retried[gid] = new
    return retried
