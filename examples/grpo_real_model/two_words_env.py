"""The example's environment: name two things of a kind, one word per turn, through a tool.

Owns the tasks (a kind of thing each), the one tool, ``say(text)``, which keeps what the
model said and asks for the next (two turns an episode: the run's ``max_turns``), and the
reward: the mean over what was said of 1/words (a one-word answer scores 1), 0 for a
word said twice and 0 when nothing was said. SmolLM2-135M rarely keeps to one word when
sampled at temperature 1, so rewards vary within a group and GRPO's advantages are not all
zero: every step moves the weights.

The model does not write tool calls itself: the example's engine answers a request that
offers tools with a call of the tool, the reply's text its argument (``engine.py`` says
why). Saved at each turn (``turn`` mode): the list of what was said.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import JsonValue

from rollpoint.envs import (
    CheckpointMode,
    Environment,
    InvalidCheckpointStateError,
    TaskRow,
    Tool,
    ToolArguments,
    VerifyReply,
)

KINDS = (
    "colour", "fruit", "animal", "country", "planet", "metal", "flower", "musical instrument",
)  # fmt: skip
WANTED = 2
"""Answers an episode asks for: one per turn (the run's ``max_turns``)."""


class SayArguments(ToolArguments):
    text: str


def _words(said: list[str]) -> list[tuple[str, ...]]:
    return [tuple(w.strip(".,!?\"'").lower() for w in s.split()) for s in said]


class TwoWordsEnvironment(Environment[list[str]]):
    name: ClassVar[str] = "two_words"
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.TURN
    reproducible_start: ClassVar[bool] = True

    def _make_task(self, index: int, rng: random.Random) -> TaskRow:
        kind = KINDS[index % len(KINDS)]
        return TaskRow(
            task_id=self.task_id(index),
            environment=self.name,
            prompt=f"Name a {kind}. Answer with one word.",
            params={"kind": kind},
        )

    def tool_table(self) -> Mapping[str, Tool[list[str], Any]]:
        return {"say": Tool("say", "Say your answer.", SayArguments, self._say)}

    def _say(self, state: list[str], args: SayArguments) -> str:
        state.append(args.text)
        if len(state) >= WANTED:
            return "Thank you."
        return "Now name another one. Answer with one word."

    def start(self, task: TaskRow) -> list[str]:
        return []

    def verify(self, state: list[str], task: TaskRow, final_message: str | None) -> VerifyReply:
        words = _words(state)
        scores = [0.0 if not w or w in words[:i] else 1.0 / len(w) for i, w in enumerate(words)]
        reward = sum(scores) / len(scores) if scores else 0.0
        return VerifyReply(reward=reward, detail={"said": list(state)})

    def export_state(self, state: list[str]) -> dict[str, JsonValue]:
        return {"said": list(state)}

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> list[str]:
        said = exported.get("said")
        if not isinstance(said, list) or not all(isinstance(s, str) for s in said):
            raise InvalidCheckpointStateError(
                f"two_words state of task {task.task_id}: 'said' must be a list of strings"
            )
        return list(said)
