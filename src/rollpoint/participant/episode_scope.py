"""The scope a commit names, as a participant's ``export`` receives it.

Owns :class:`EpisodeScope`: the distinct episode keys (``rollout#attempt``) of one commit,
sorted, read as a sequence of :class:`~rollpoint.protocol.ids.EpisodeId` by any
participant, and as keys or ``(rollout_id, attempt)`` pairs by those that want it cheap.
A commit runs inside the snapshot pause and names every in-flight episode of a replica
(5,000 at 10k sessions on two replicas): building an ``EpisodeId`` for each costs ~1.5 µs,
splitting its key ~0.2 µs. So ids are built only when a participant indexes or iterates
the scope as ids, once, and kept.

It does not parse requests (the fence builds a scope from a commit's ``episode_ids`` and
``episode_keys``) nor decide what a participant saves.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import overload

from rollpoint.protocol.ids import EpisodeId


class EpisodeScope(Sequence[EpisodeId]):
    """Distinct episodes in key order; equal scopes have equal :attr:`keys`."""

    __slots__ = ("_ids", "_key_set", "_keys")

    def __init__(self, keys: Iterable[str]) -> None:
        """``keys``: well-formed episode keys (the wire validated them), in any order,
        duplicates allowed."""
        self._key_set = frozenset(keys)
        # Sorted on first use: a commit builds its scope inside the pause, and our
        # participants read it in order only after it, in the writer's thread (sorting
        # 50k keys: ~10 ms).
        self._keys: list[str] | None = None
        self._ids: list[EpisodeId] | None = None

    @classmethod
    def of(cls, episodes: Iterable[EpisodeId]) -> EpisodeScope:
        return cls(e.key for e in episodes)

    @property
    def keys(self) -> list[str]:
        """The keys, sorted; do not change the list."""
        if self._keys is None:
            self._keys = sorted(self._key_set)
        return self._keys

    @property
    def key_set(self) -> frozenset[str]:
        return self._key_set

    def pairs(self) -> Iterator[tuple[str, int]]:
        """``(rollout_id, attempt)`` of each episode, in key order, without building ids."""
        for key in self.keys:
            rollout_id, _, attempt = key.rpartition("#")
            yield rollout_id, int(attempt)

    def _materialised(self) -> list[EpisodeId]:
        if self._ids is None:
            self._ids = [EpisodeId.from_key(k) for k in self.keys]
        return self._ids

    def __len__(self) -> int:
        return len(self._key_set)

    def __contains__(self, value: object) -> bool:
        return isinstance(value, EpisodeId) and value.key in self._key_set

    def __iter__(self) -> Iterator[EpisodeId]:
        return iter(self._materialised())

    @overload
    def __getitem__(self, index: int) -> EpisodeId: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[EpisodeId]: ...

    def __getitem__(self, index: int | slice) -> EpisodeId | Sequence[EpisodeId]:
        return self._materialised()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EpisodeScope):
            return self._key_set == other._key_set
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._key_set)

    def __repr__(self) -> str:
        shown = ", ".join(self.keys[:3])
        return f"EpisodeScope([{shown}{', …' if len(self) > 3 else ''}], {len(self)})"


def latest_attempts(scope: Iterable[EpisodeId]) -> dict[str, int]:
    """Rollout id → its highest attempt in ``scope``: what participants that file their
    state by rollout (calls, environment state) save it for."""
    latest: dict[str, int] = {}
    for rollout_id, attempt in episode_pairs(scope):
        if attempt > latest.get(rollout_id, -1):
            latest[rollout_id] = attempt
    return latest


def episode_pairs(scope: Iterable[EpisodeId]) -> Iterator[tuple[str, int]]:
    """``(rollout_id, attempt)`` of each episode of ``scope``: from the keys when it is an
    :class:`EpisodeScope`, else from each id."""
    if isinstance(scope, EpisodeScope):
        return scope.pairs()
    return ((e.rollout_id, e.attempt) for e in scope)
