"""Custom agent loops (see :mod:`rollpoint.agent_loops.agent_loop` for the contract)."""

from rollpoint.agent_loops.agent_loop import AgentLoop, Prompt, resolve_agent_loop

__all__ = ["AgentLoop", "Prompt", "resolve_agent_loop"]
