"""Custom agent loops: the contract, and the lookup of one named by import path.

The agent server plays every episode with one tool-calling loop: policy call, tool calls,
again, until a final message or ``max_turns``. An :class:`AgentLoop` changes what the policy
is *sent* each turn (a summary in place of older turns, a scaffold's own prompt format),
with a per-episode state the agent saves and restores for it.

The contract:

- :meth:`AgentLoop.prompt` is called right before each policy call with the loop's state
  after the previous turn (``None`` before the first), the whole transcript so far (what
  the trainer gets; never changed by the loop) and the turn index. It returns the messages
  to send and the next state.
- A *turn boundary* is the moment a policy reply is applied to the session. The next state
  is kept only then, together with the reply: a checkpoint that saves a session as before
  a call (its reply not applied) saves the state as before it too, and after a restore the
  loop is handed the saved state and asked for that turn again.
- So ``prompt`` must be a pure function of its arguments (no clock, no unseeded
  randomness, nothing kept on ``self``), and the state must be JSON (dicts, lists,
  strings, numbers, booleans, null), new each turn (never changed in place).

Config: ``agent_loop: package.module:ClassName`` (None: the messages go as they are).
Resolved when the config is loaded, and again in each agent process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import JsonValue

from rollpoint.common.import_path import load_class
from rollpoint.protocol.errors import ConfigError

Prompt = tuple[list[dict[str, Any]], JsonValue]
"""What a turn sends the policy, and the loop's state once the turn is applied."""


class AgentLoop(ABC):
    """Decides what the policy is sent each turn; its per-episode state is JSON."""

    @abstractmethod
    def prompt(
        self, state: JsonValue, messages: Sequence[Mapping[str, Any]], turn: int
    ) -> Prompt: ...


def resolve_agent_loop(ref: str) -> type[AgentLoop]:
    """The loop class ``ref`` names (``package.module:ClassName``); ConfigError otherwise."""
    if ":" not in ref:
        raise ConfigError(f"agent loop {ref!r}: not an import path (want package.module:ClassName)")
    cls: type[AgentLoop] = load_class(
        ref, AgentLoop, what="agent loop", base_name="rollpoint.agent_loops.AgentLoop"
    )
    return cls
