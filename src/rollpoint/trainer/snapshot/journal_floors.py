"""Journal floors: the oldest journal position a journal-mode snapshot may need, per participant.

A journal-mode snapshot (``snapshot.mode: journal``, docs/design.md "Pause-free
snapshots") saves no episode state: on restore every try it holds in flight is sent again
under its own id and brought forward from its replica's journals, from the try's first
record on. So each participant's manifest must name, as its journal mark, a position at or
before the first record of every such try: retention deletes the segments below the
oldest mark a kept snapshot names, and a mark at the position of the save itself would let
it delete the early turns of a long episode still in flight.

Owns :class:`JournalFloors`, which picks that mark from what the trainer already knows,
without asking the servers more than their position:

- at each journal-mode save it scans the ledger's live tries (on the loop, in one step:
  at the save's start and at the trainer's capture, after every reply) and remembers, for every try it sees touched (dispatched, or moved since) for the
  first time, the time of the *previous* scan: the try had no record anywhere before then
  (it was untouched, or not yet made, at that scan);
- a try live at the first scan after this coordinator started (a restore, a fresh run)
  gets no bound: it may have journaled in an earlier process;
- each save's positions are remembered with the time its last reply arrived; the floor of
  a participant is its position in the newest save whose replies all arrived before the
  oldest live try was first seen (every position in it was taken before that try began),
  or none (the whole journal is kept: segment 1) when no save qualifies.

Forgotten tries (sealed, retired) leave the scan; older saves than the chosen one are
dropped, so memory is O(live tries + saves since the oldest live try began). It does not
send anything or write anything (the coordinator does); it never reads a journal.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable

from rollpoint.protocol.manifest import JournalMark
from rollpoint.trainer.state.ledger_record import LedgerRecord

__all__ = ["JournalFloors"]


class JournalFloors:
    """The floors of one coordinator's journal-mode saves (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._first_seen: dict[str, float] = {}
        """Live rollout → before this time it had no record anywhere (-inf: unknown)."""
        self._last_scan: float | None = None
        self._saves: deque[tuple[float, dict[str, JournalMark]]] = deque()
        """(time the save's last reply arrived, participant label → its position), oldest
        first."""

    def observe(self, live: Iterable[LedgerRecord]) -> float:
        """Scan the ledger's live tries (every one not sealed or retired) now; returns the
        scan's time. Each save scans at its start and again at the trainer's capture."""
        now = self._clock()
        since = -math.inf if self._last_scan is None else self._last_scan
        alive: set[str] = set()
        for record in live:
            alive.add(record.rollout_id)
            if not record.untouched:
                self._first_seen.setdefault(record.rollout_id, since)
        for rollout_id in [r for r in self._first_seen if r not in alive]:
            del self._first_seen[rollout_id]
        self._last_scan = now
        return now

    def floors(self, live: Iterable[LedgerRecord]) -> dict[str, JournalMark]:
        """The floor of every participant with one, for a save starting now; a label
        missing from the result has none (keep its whole journal). ``live``: as for
        :meth:`observe`."""
        now = self.observe(live)
        oldest = min(self._first_seen.values(), default=now)
        chosen = None
        while self._saves and self._saves[0][0] <= oldest:
            chosen = self._saves.popleft()
        if chosen is None:
            return {}
        self._saves.appendleft(chosen)  # still the floor until a newer one qualifies
        return dict(chosen[1])

    def reported(self, positions: dict[str, JournalMark]) -> None:
        """Every participant of a save replied with its position (now)."""
        self._saves.append((self._clock(), dict(positions)))

    @property
    def tracked(self) -> int:
        """Live tries with a first-seen time (memory check)."""
        return len(self._first_seen)
