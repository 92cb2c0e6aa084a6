"""Retire marks: for each rollout, the highest attempt retired, and the one check against them.

Owns the marks of one participant: ``rollout_id → attempt``. Work of an attempt at or
under its rollout's mark is refused (:meth:`RetireMarks.check`, ``409 stale_attempt``); the
next attempt is not retired. Marks only rise, until forgotten.

One owner writes them: the participant's :class:`~rollpoint.participant.fence.Fence` (its
``retire`` and ``restore`` verbs raise them, ``forget`` drops them; see ``Fence.marks``).
Servers only read them: the model and resources servers through
:meth:`~rollpoint.participant.fence.Fence.check_attempt`, the agent's session book by holding the
fence's :class:`RetireMarks` (``SessionBook.marks``). Nothing keeps a second copy, so
nothing has to be kept in step.

Every operation is O(1) per rollout named. One event loop, not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rollpoint.protocol.errors import StaleAttemptError
from rollpoint.protocol.ids import EpisodeId


class RetireMarks:
    """The retire marks of one participant (the fence writes, servers read)."""

    __slots__ = ("_marks",)

    def __init__(self) -> None:
        self._marks: dict[str, int] = {}

    # --- read side ---------------------------------------------------------------------

    def __len__(self) -> int:
        """Rollouts with a mark."""
        return len(self._marks)

    def get(self, rollout_id: str) -> int | None:
        """The highest retired attempt of ``rollout_id``, or None."""
        return self._marks.get(rollout_id)

    def is_retired(self, episode: EpisodeId) -> bool:
        mark = self._marks.get(episode.rollout_id)
        return mark is not None and episode.attempt <= mark

    def check(self, episode: EpisodeId) -> None:
        """Refuse work of a retired attempt with :class:`StaleAttemptError`."""
        mark = self._marks.get(episode.rollout_id)
        if mark is not None and episode.attempt <= mark:
            raise StaleAttemptError(
                f"episode {episode.key} is retired (attempts up to {mark} of rollout "
                f"{episode.rollout_id} are); a newer attempt owns it"
            )

    def as_dict(self) -> dict[str, int]:
        """A copy of every mark."""
        return dict(self._marks)

    # --- the owner's side --------------------------------------------------------------

    def raise_to(self, wanted: Mapping[str, int]) -> dict[str, int]:
        """Raise each rollout's mark to at least ``wanted``; return the marks now held for
        those rollouts (a lower ``wanted`` leaves a higher mark as it is)."""
        marks = self._marks
        for rollout_id, attempt in wanted.items():
            held = marks.get(rollout_id)
            if held is None or attempt > held:
                marks[rollout_id] = attempt
        return {rollout_id: marks[rollout_id] for rollout_id in wanted}

    def drop(self, rollout_ids: Iterable[str]) -> list[str]:
        """Forget the marks of these rollouts; returns the ids that had one."""
        marks = self._marks
        return [r for r in dict.fromkeys(rollout_ids) if marks.pop(r, None) is not None]
