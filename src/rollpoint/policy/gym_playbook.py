"""The scripted policy's playbook for ``gymnasium:<env id>`` environments (the ``gym_step`` tool).

Owns one decision: while the newest ``gym_step`` result says the episode goes on, call
``gym_step`` with an action drawn from the tool's JSON schema (an integer within its
``minimum``/``maximum``, a string within its lengths) by the turn's own rng; once a result
says ``terminated`` or ``truncated``, answer with how the episode ended. With that, CI runs
any Gymnasium environment with no model: the actions are random, the replay and restore
paths are real. It never imports the environment: it reads the tool spec and the JSON
results (``{"step", "observation", "reward", "terminated", "truncated", "text"}``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from rollpoint.policy.schema_arguments import sample_arguments

if TYPE_CHECKING:
    from rollpoint.policy.playbook import Turn

STEP_TOOL = "gym_step"


def _step_result(result: str) -> dict[str, Any] | None:
    try:
        reply = orjson.loads(result)
    except orjson.JSONDecodeError:
        return None
    if isinstance(reply, dict) and isinstance(reply.get("terminated"), bool):
        return reply
    return None


def next_step(turn: Turn) -> dict[str, Any] | str:
    """The arguments of the next ``gym_step`` call, or the final answer."""
    last = turn.transcript.latest(STEP_TOOL, _step_result)
    if last is not None and (last["terminated"] or last.get("truncated") is True):
        how = "terminated" if last["terminated"] else "was cut off (truncated)"
        return (
            f"The episode {how} after {last.get('step')} step(s);"
            f" the last reward was {last.get('reward')}."
        )
    spec = turn.specs.get(STEP_TOOL)
    return sample_arguments(spec, turn.turn_rng)
