"""GRPO advantages: each rollout's reward normalised within its prompt group.

``advantage = (reward - mean) / (std + 1e-6)`` with the population std of the group's
rewards. A group whose rewards are all equal carries no signal: every advantage is
exactly 0 (not a tiny float from rounding). This module only computes numbers; it does
not know about the finished queue, the ledger or train steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from rollpoint.protocol.episode import RunReply
from rollpoint.protocol.errors import BadRequestError

EPSILON = 1e-6


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """Advantages of one group's rewards, in the same order."""
    if not rewards:
        raise BadRequestError("grpo: a group has at least one reward")
    if any(not math.isfinite(r) for r in rewards):
        raise BadRequestError(f"grpo: rewards must be finite, got {list(rewards)}")
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)
    mean = math.fsum(rewards) / len(rewards)
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + EPSILON) for r in rewards]


def advantages_by_episode(groups: Iterable[Sequence[RunReply]]) -> dict[str, float]:
    """Advantages of every rollout of the given groups, keyed by episode key (``r7#0``)."""
    out: dict[str, float] = {}
    for replies in groups:
        for reply, advantage in zip(
            replies, group_advantages([r.reward for r in replies]), strict=True
        ):
            out[reply.episode.key] = advantage
    return out
