"""What a checkpoint participant is: its kind and how it takes part in a checkpoint."""

from __future__ import annotations

from enum import StrEnum


class ParticipantKind(StrEnum):
    MODEL = "model"
    """The policy model server: owns the admission gate and the call ledger."""
    AGENT = "agent"
    """The agent server: owns the sessions that play episodes."""
    RESOURCES = "resources"
    """The resources (tools) server: owns per-episode environment state."""


class CheckpointMode(StrEnum):
    TURN = "turn"
    """State is exported at turn boundaries; episodes continue mid-conversation."""
    RESTART_ONLY = "restart_only"
    """In-flight episodes cannot be captured; they are reported as restarts and start over."""
    STATELESS = "stateless"
    """Nothing to save."""
