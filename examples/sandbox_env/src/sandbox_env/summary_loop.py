"""An example custom agent loop: every few turns, older turns are folded into a summary.

The policy is sent the task prompt, one user message summarizing the folded turns (each
tool call and the start of its result), and the turns since. The transcript itself (what
the trainer gets) keeps everything. The loop's state, saved by rollpoint with the session at
each turn boundary and handed back after a restore, is ``{"summary": [lines], "folded": n}``:
the summary so far and how many transcript messages (after the prompt) it covers.

``agent_loop: sandbox_env.summary_loop:SummarizingLoop`` in a config uses it. Uses only
rollpoint's public API (``rollpoint.agent_loops``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pydantic import JsonValue

from rollpoint.agent_loops import AgentLoop, Prompt

_RESULT_CHARS = 40


def _lines(folded: Sequence[Mapping[str, Any]]) -> list[str]:
    results = {m.get("tool_call_id"): str(m.get("content")) for m in folded if m["role"] == "tool"}
    lines = []
    for message in folded:
        for call in message.get("tool_calls") or ():
            fn = call.get("function") or {}
            result = results.get(call.get("id"), "")[:_RESULT_CHARS]
            lines.append(f"- {fn.get('name')}({fn.get('arguments')}) -> {result}")
    return lines


class SummarizingLoop(AgentLoop):
    """Folds every turn but the last one into the summary, every ``every`` turns."""

    every: ClassVar[int] = 3

    def prompt(self, state: JsonValue, messages: Sequence[Mapping[str, Any]], turn: int) -> Prompt:
        summary: list[str] = []
        folded = 0
        if isinstance(state, dict):
            summary = [str(line) for line in state.get("summary") or []]  # type: ignore[union-attr]
            folded = int(state.get("folded") or 0)  # type: ignore[arg-type]
        if turn > 0 and turn % self.every == 0:
            # Fold up to the last assistant message: a tool result stays with its call.
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            summary = summary + _lines(messages[1 + folded : last])
            folded = last - 1
        sent = [dict(messages[0])]
        if summary:
            text = "Summary of the earlier steps:\n" + "\n".join(summary)
            sent.append({"role": "user", "content": text})
        sent.extend(dict(m) for m in messages[1 + folded :])
        return sent, {"summary": list(summary), "folded": folded}
