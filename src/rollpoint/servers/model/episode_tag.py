"""The episode headers of a policy call, and the tagged calls running now.

Owns :class:`EpisodeTag`: a call's ``x-rollpoint-rollout-id``, ``x-rollpoint-attempt`` and
``x-rollpoint-turn`` headers, parsed once and checked. None of them: the call is not an
episode's and is proxied unrecorded; any of them: all three must be there, the rollout id an
identifier and the attempt and turn plain ASCII digits no larger than an episode id holds,
or the call is refused with 400 naming the header. And :class:`RunningCalls`: the tagged
calls past the admission gate and not finished, by rollout and attempt (O(1) per call),
which the participant reads to tell a retired attempt with a call running.

Does not own: the ``stale_attempt`` check a tag is put to (the fence's), nor the gate.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from itertools import islice

from rollpoint.protocol.errors import BadRequestError
from rollpoint.protocol.ids import (
    HEADER_ATTEMPT,
    HEADER_ROLLOUT_ID,
    HEADER_TURN,
    MAX_ATTEMPT,
    EpisodeId,
    is_identifier,
)


class EpisodeTag:
    """The episode headers of one call, parsed and checked."""

    __slots__ = ("attempt", "rollout_id", "turn")

    def __init__(self, rollout_id: str, attempt: int, turn: int) -> None:
        self.rollout_id = rollout_id
        self.attempt = attempt
        self.turn = turn

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> EpisodeTag | None:
        """None when the call carries no episode headers; 400 naming a bad or missing one."""
        rollout_id = headers.get(HEADER_ROLLOUT_ID)
        attempt = headers.get(HEADER_ATTEMPT)
        turn = headers.get(HEADER_TURN)
        if rollout_id is None and attempt is None and turn is None:
            return None
        if rollout_id is None or not is_identifier(rollout_id):
            raise BadRequestError(f"header {HEADER_ROLLOUT_ID} must be an identifier")
        return cls(rollout_id, _header_int(HEADER_ATTEMPT, attempt), _header_int(HEADER_TURN, turn))

    @property
    def episode(self) -> EpisodeId:
        # Both parts were checked by from_headers: skip a second validation on the hot path.
        return EpisodeId.model_construct(rollout_id=self.rollout_id, attempt=self.attempt)


class RunningCalls:
    """Tagged calls past the gate and not finished, by rollout and attempt; O(1) per call."""

    def __init__(self) -> None:
        self._by_rollout: dict[str, dict[int, int]] = {}

    @contextmanager
    def track(self, tag: EpisodeTag | None) -> Iterator[None]:
        if tag is None:
            yield
            return
        attempts = self._by_rollout.setdefault(tag.rollout_id, {})
        attempts[tag.attempt] = attempts.get(tag.attempt, 0) + 1
        try:
            yield
        finally:
            left = attempts[tag.attempt] - 1
            if left:
                attempts[tag.attempt] = left
            else:
                del attempts[tag.attempt]
                if not attempts:
                    del self._by_rollout[tag.rollout_id]

    def attempts(self, rollout_id: str) -> list[int]:
        """The attempts of ``rollout_id`` with a call running now."""
        return sorted(self._by_rollout.get(rollout_id, ()))

    def keys(self, limit: int) -> list[str]:
        """Up to ``limit`` episode keys with a call running now."""
        every = (
            f"{rollout_id}#{attempt}"
            for rollout_id, attempts in self._by_rollout.items()
            for attempt in attempts
        )
        return list(islice(every, limit))


def _header_int(name: str, value: str | None) -> int:
    # ASCII digits only (str.isdigit() takes "²", which int() refuses), and no more than an
    # EpisodeId holds: a header of 10**23 once broke every later commit of its rollout.
    if (
        value is None
        or not (value.isascii() and value.isdigit())
        or len(value) > len(str(MAX_ATTEMPT))
        or int(value) > MAX_ATTEMPT
    ):
        raise BadRequestError(
            f"header {name} must be an integer from 0 to {MAX_ATTEMPT}, got {value[:40]!r}"
            if value is not None
            else f"header {name} must be an integer from 0 to {MAX_ATTEMPT}, got none"
        )
    return int(value)
