"""Policy lag: how many versions behind the live policy a rollout's turns are, and the bound
on it (``train.max_policy_lag``).

Owns :class:`PolicyLag`:

- each untrained row's *oldest version* (by group and row): the live version when its try
  was sent (its turns can only be as new or newer), then, once it finished, the oldest
  version any of its turns was sampled under (a call that spanned a weight update counts
  its first segment). A continued try (a restore continued it, same rollout) keeps the
  version of its pre-crash turns; a fresh try (a new rollout id) starts over. Saved with
  every snapshot (:meth:`PolicyLag.to_doc`), so a restored run counts pre-crash turns.
- the dispatch hold: new episodes wait (:meth:`PolicyLag.wait_open`) while the oldest
  untrained row is ``max_policy_lag`` versions behind or more and the run can still make
  progress without them (rows in flight, or a batch ready to train): once the lagging
  rows are trained, the hold lifts. It also holds while a run restored from a snapshot
  waits for the trainer to say which version is live (the trainer had reported its own:
  until it does, a call would be stamped with a version the engines may not run).
- the lag of a sample at training time (:func:`sample_lag`): live version minus its oldest
  turn's, per turn too.

Does not own: what happens to a sample beyond the bound (the trainer: re-sent or marked,
``train.stale_samples``), nor stamping versions (the model servers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from rollpoint.protocol.episode import ModelCall, RunReply

log = logging.getLogger(__name__)

RECHECK_S = 0.5
"""A held dispatch looks again at least this often (rows in flight also end by failing)."""


def call_oldest(call: ModelCall) -> int:
    """The oldest version that sampled any token of ``call``."""
    if call.segments:
        return min(s.policy_version for s in call.segments)
    return call.policy_version


def turn_lags(calls: Iterable[ModelCall], live: int) -> list[int]:
    """Each call's lag: ``live`` minus its oldest version (never below 0)."""
    return [max(live - call_oldest(c), 0) for c in calls]


def sample_lag(calls: list[ModelCall], live: int) -> int:
    """A sample's lag: its oldest turn's (0 for a sample without calls)."""
    return max(turn_lags(calls, live), default=0)


def _slot(group_id: str, row: int) -> str:
    return f"{group_id}#{row}"


class PolicyLag:
    """Each untrained row's oldest version, and the dispatch hold (module docstring)."""

    def __init__(
        self,
        max_lag: int | None,
        *,
        live: Callable[[], int],
        busy: Callable[[], bool],
        awaiting_trainer: bool = False,
    ) -> None:
        self.max_lag = max_lag
        self._live = live
        self._busy = busy
        self.awaiting_trainer = awaiting_trainer
        """A restored run whose trainer reported its own versions: hold until it says
        which is live (:meth:`trainer_reported`)."""
        self._slots: dict[str, tuple[str, int]] = {}
        """``group#row`` → (rollout id of its latest try, the oldest version in it)."""
        self._changed = asyncio.Event()
        self.holds = 0
        """How many times a dispatch waited for the bound (not for the trainer)."""
        self._warned = False

    # --- the rows ----------------------------------------------------------------------

    def sent(self, group_id: str, row: int, rollout_id: str) -> None:
        """A try of the row goes out: a fresh one starts at the live version."""
        if self.max_lag is None:
            return
        key = _slot(group_id, row)
        known = self._slots.get(key)
        if known is None or known[0] != rollout_id:
            self._slots[key] = (rollout_id, self._live())

    def finished(self, reply: RunReply) -> None:
        """The row's try finished: its oldest turn is known now."""
        if self.max_lag is None:
            return
        key = _slot(reply.group_id, reply.row)
        known = self._slots.get(key)
        oldest = min((call_oldest(c) for c in reply.model_calls), default=None)
        if oldest is None:
            oldest = known[1] if known is not None else self._live()
        elif known is not None and known[0] == reply.episode.rollout_id:
            oldest = min(oldest, known[1])
        self._slots[key] = (reply.episode.rollout_id, oldest)
        self.changed()

    def settled(self, group_id: str, rows: int) -> None:
        """The group was trained, failed or replaced: its rows lag no more."""
        for row in range(rows):
            self._slots.pop(_slot(group_id, row), None)
        self.changed()

    def oldest(self) -> int | None:
        return min((v for _, v in self._slots.values()), default=None)

    # --- the hold ------------------------------------------------------------------------

    def trainer_reported(self) -> None:
        self.awaiting_trainer = False
        self.changed()

    def changed(self) -> None:
        """Something the hold reads changed (a version, a row, a train step)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def lagging(self) -> bool:
        if self.max_lag is None:
            return False
        oldest = self.oldest()
        return oldest is not None and self._live() - oldest >= self.max_lag

    @property
    def is_open(self) -> bool:
        if self.awaiting_trainer:
            return False
        return not (self.lagging() and self._busy())

    async def wait_open(self) -> None:
        """Return once new episodes may be sent."""
        counted = False
        while not self.is_open:
            if self.awaiting_trainer and not self._warned:
                self._warned = True
                log.warning(
                    "restored run: no episode is sent until the trainer says which policy "
                    "version is live (rollouts.weights_live or weight_update)"
                )
            elif not self.awaiting_trainer and not counted:
                counted = True
                self.holds += 1
            changed = self._changed
            try:
                async with asyncio.timeout(RECHECK_S):
                    await changed.wait()
            except TimeoutError:
                pass

    # --- saved with a snapshot -----------------------------------------------------------

    def to_doc(self) -> dict[str, Any] | None:
        if self.max_lag is None:
            return None
        return {key: [rid, version] for key, (rid, version) in self._slots.items()}

    def load(self, doc: Any) -> None:
        if self.max_lag is None or not isinstance(doc, dict):
            return
        for key, value in doc.items():
            if isinstance(key, str) and isinstance(value, list) and len(value) == 2:
                rid, version = value
                if isinstance(rid, str) and isinstance(version, int):
                    self._slots[key] = (rid, version)
