"""A commit's scope as participants read it: distinct keys in order, ids built only on demand."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rollpoint.participant.episode_scope import EpisodeScope, episode_pairs, latest_attempts
from rollpoint.protocol.ids import EpisodeId

episodes = st.builds(
    EpisodeId,
    rollout_id=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,20}", fullmatch=True),
    attempt=st.integers(0, 50),
)


@given(st.lists(episodes, max_size=30))
def test_a_scope_is_the_distinct_episodes_in_key_order_whichever_way_it_is_read(
    given_ids: list[EpisodeId],
) -> None:
    scope = EpisodeScope(e.key for e in given_ids)
    expected = sorted({e.key: e for e in given_ids}.values(), key=lambda e: e.key)
    assert scope.keys == [e.key for e in expected]
    assert list(scope.pairs()) == [(e.rollout_id, e.attempt) for e in expected]
    assert list(episode_pairs(scope)) == list(episode_pairs(expected))
    assert list(scope) == expected and len(scope) == len(expected)
    assert scope == EpisodeScope.of(reversed(given_ids))


def test_ids_are_built_only_when_read_as_ids() -> None:
    scope = EpisodeScope(["r2#0", "r1#3", "r2#0"])
    assert list(scope.pairs()) == [("r1", 3), ("r2", 0)]
    assert scope._ids is None  # reading keys or pairs built no EpisodeId
    assert scope[0] == EpisodeId(rollout_id="r1", attempt=3)
    assert scope[1:] == [EpisodeId(rollout_id="r2")]
    assert (
        EpisodeId(rollout_id="r2") in scope and EpisodeId(rollout_id="r2", attempt=1) not in scope
    )
    assert scope != EpisodeScope(["r1#3"]) and "r1#3" in scope.key_set


def test_a_rollout_id_with_a_hash_splits_at_the_last_one() -> None:
    # Identifiers cannot hold '#', but the split must not depend on it.
    assert list(EpisodeScope(["a.b:c-1#12"]).pairs()) == [("a.b:c-1", 12)]


@given(st.lists(episodes, max_size=30))
def test_latest_attempts_keeps_each_rollouts_highest_attempt(given_ids: list[EpisodeId]) -> None:
    expected: dict[str, int] = {}
    for e in given_ids:
        expected[e.rollout_id] = max(expected.get(e.rollout_id, -1), e.attempt)
    assert latest_attempts(given_ids) == expected
    assert latest_attempts(EpisodeScope.of(given_ids)) == expected
