"""GRPO advantages: zero-mean per group, scale invariant, zero when there is no signal."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollpoint.protocol.errors import BadRequestError
from rollpoint.trainer.grpo import EPSILON, group_advantages

rewards_st = st.lists(
    st.floats(min_value=-100, max_value=100, allow_nan=False, allow_infinity=False),
    min_size=1,
    max_size=64,
)


def _std(rewards: list[float]) -> float:
    mean = math.fsum(rewards) / len(rewards)
    return math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))


@given(rewards_st)
def test_advantages_have_zero_mean_per_group(rewards: list[float]) -> None:
    advantages = group_advantages(rewards)
    assert len(advantages) == len(rewards)
    assert abs(math.fsum(advantages) / len(advantages)) < 1e-6


@given(rewards_st, st.floats(min_value=0.01, max_value=100))
def test_advantages_are_scale_invariant(rewards: list[float], scale: float) -> None:
    if _std(rewards) * min(scale, 1.0) < 1e-2:
        # Near-constant groups (before or after scaling): the epsilon weighs more than the
        # 1e-3 tolerance and there is nothing to test.
        return
    a = group_advantages(rewards)
    b = group_advantages([r * scale for r in rewards])
    assert all(math.isclose(x, y, rel_tol=1e-3, abs_tol=1e-3) for x, y in zip(a, b, strict=True))


@given(st.floats(min_value=-1e6, max_value=1e6), st.integers(min_value=1, max_value=32))
def test_equal_rewards_give_exactly_zero(reward: float, n: int) -> None:
    assert group_advantages([reward] * n) == [0.0] * n


def test_known_values_use_the_population_std() -> None:
    # rewards 0 and 1: mean 0.5, population std 0.5
    assert group_advantages([0.0, 1.0]) == pytest.approx(
        [-0.5 / (0.5 + EPSILON), 0.5 / (0.5 + EPSILON)]
    )


def test_an_empty_or_non_finite_group_is_refused() -> None:
    with pytest.raises(BadRequestError):
        group_advantages([])
    with pytest.raises(BadRequestError):
        group_advantages([1.0, math.nan])
