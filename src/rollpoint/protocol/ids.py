"""Identities: episodes, rollouts, attempts, checkpoints, and the headers that carry them.

- ``task_id``: a dataset row. ``group_id`` + ``row``: one sample of a prompt group.
- ``rollout_id``: one episode from its first turn; a fresh re-send gets a new one.
- ``attempt``: how many times this same episode was continued after a restore.
  ``r7#0`` is rollout r7, attempt 0; after a restore it continues as ``r7#1``.
- Tool idempotency key ``(rollout_id, turn, call_index)`` is stable across attempts,
  so a continued episode never repeats a side effect applied before the cut.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Self

from pydantic import ConfigDict, Field, StringConstraints

from rollpoint.protocol.model_base import StrictModel

IDENTIFIER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
_IDENTIFIER_RE = re.compile(IDENTIFIER_PATTERN)

Identifier = Annotated[
    str, StringConstraints(min_length=1, max_length=128, pattern=IDENTIFIER_PATTERN)
]
"""A name safe in URLs, file names and logs: ``[A-Za-z0-9][A-Za-z0-9._:-]*``, at most 128 chars."""

CheckpointId = Identifier
EPISODE_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*#[0-9]+$"
EpisodeKey = Annotated[
    str, StringConstraints(min_length=3, max_length=150, pattern=EPISODE_KEY_PATTERN)
]
"""An episode's compact form ``rollout_id#attempt`` (:attr:`EpisodeId.key`), where a list of
thousands is sent: a string validates an order of magnitude faster than a nested model."""

MAX_ATTEMPT = 2**53
"""Attempts stay exact in every JSON reader (a double holds integers up to 2**53)."""

# Headers the agent sets on every model call so the model server can file it by episode.
HEADER_ROLLOUT_ID = "x-rollpoint-rollout-id"
HEADER_ATTEMPT = "x-rollpoint-attempt"
HEADER_TURN = "x-rollpoint-turn"
# The model server sets this on every completion it returns: the policy version that served it.
HEADER_POLICY_VERSION = "x-rollpoint-policy-version"


def is_identifier(value: str) -> bool:
    return len(value) <= 128 and _IDENTIFIER_RE.match(value) is not None


def new_rollout_id() -> str:
    """A fresh rollout id: unique across runs and restarts, short enough to read in logs."""
    return "r" + uuid.uuid4().hex[:16]


class _EpisodeKeyCache:
    """:attr:`EpisodeId.key`, made on first use and kept in the instance's ``__dict__``.

    Not :func:`functools.cached_property`: on 3.11 that takes a lock on every first use,
    which measured 2.5x the cost of making the key, and a commit keys thousands of freshly
    parsed ids inside the snapshot pause. A non-data descriptor: once the instance holds
    the key, attribute lookup finds it there and never calls this again.
    """

    def __get__(self, obj: EpisodeId | None, owner: Any = None) -> Any:
        if obj is None:
            return self
        key = f"{obj.rollout_id}#{obj.attempt}"
        obj.__dict__["key"] = key
        return key


class EpisodeId(StrictModel):
    """One try of one episode: a rollout id and its attempt number."""

    model_config = ConfigDict(extra="forbid", frozen=True, ignored_types=(_EpisodeKeyCache,))

    rollout_id: Identifier
    attempt: Annotated[int, Field(ge=0, le=MAX_ATTEMPT)] = 0

    if TYPE_CHECKING:

        @property
        def key(self) -> str:
            """The compact form used in logs, file records and dict keys: ``r7#0``. Cached
            (the model is frozen): a commit keys a scope of thousands several times in its
            pause."""
            ...
    else:
        key = _EpisodeKeyCache()

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        # A copy starts from this instance's __dict__, cached key included: drop it, or a
        # copy with another attempt would keep this one's key.
        copy = super().model_copy(update=update, deep=deep)
        copy.__dict__.pop("key", None)
        return copy

    @classmethod
    def from_key(cls, key: str) -> EpisodeId:
        rollout_id, sep, attempt = key.rpartition("#")
        if not sep or not attempt.isdigit():
            raise ValueError(f"not an episode key (want 'rollout#attempt'): {key!r}")
        return cls(rollout_id=rollout_id, attempt=int(attempt))

    def next_attempt(self) -> EpisodeId:
        return EpisodeId(rollout_id=self.rollout_id, attempt=self.attempt + 1)

    def __str__(self) -> str:
        return self.key
