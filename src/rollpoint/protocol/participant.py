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
    EXTERNAL = "external"
    """The episode state lives outside rollpoint (a sandbox, a container, a remote service):
    nothing of it is exported, only its version (and a snapshot handle, if its owner can
    take one). After a crash an episode continues if its environment reattaches to state at
    the version it was journaled at; otherwise it restarts and is reported as restarted."""


def session_mode(environment_mode: CheckpointMode) -> CheckpointMode:
    """How an agent saves the sessions of an environment of ``environment_mode``: an
    ``external`` environment's sessions are saved at turn boundaries like a ``turn`` one's
    (only the environment's state is outside; the conversation is the agent's)."""
    if environment_mode is CheckpointMode.EXTERNAL:
        return CheckpointMode.TURN
    return environment_mode
