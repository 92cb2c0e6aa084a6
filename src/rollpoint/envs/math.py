"""The ``math`` environment: one arithmetic question, answered in a single turn, no tools.

Declared ``restart_only``: an unfinished episode is simply asked again, so there is no
state worth saving (export is empty, restore gives a fresh episode). The verifier takes the
last integer of the final message.

Prompt (parsed by the scripted policy, keep it character for character)::

    What is 17 * 23? Answer with the number only.
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, JsonValue, ValidationError, model_validator

from rollpoint.envs.base import Environment
from rollpoint.protocol.episode import TaskRow, VerifyReply
from rollpoint.protocol.errors import EpisodeError, InvalidCheckpointStateError
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import CheckpointMode

Operator = Literal["+", "-", "*"]
_APPLY: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
# A digit group separator is dropped first so "9,801" reads as 9801.
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_INTEGER_RE = re.compile(r"-?\d+")

SmallInt = Annotated[int, Field(ge=-10_000, le=10_000)]


class MathParams(StrictModel):
    a: SmallInt
    b: SmallInt
    op: Operator
    answer: int

    @model_validator(mode="after")
    def _answer_matches(self) -> MathParams:
        if _APPLY[self.op](self.a, self.b) != self.answer:
            raise ValueError(f"answer {self.answer} is not {self.a} {self.op} {self.b}")
        return self


@dataclass
class MathState:
    """Nothing changes during a math episode; the type exists so every env looks alike."""


def math_prompt(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}? Answer with the number only."


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (a leading minus sign included), if any."""
    found = _INTEGER_RE.findall(_THOUSANDS_RE.sub("", text))
    return int(found[-1]) if found else None


def _params(task: TaskRow) -> MathParams:
    try:
        return MathParams.model_validate(task.params)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "params"
        raise EpisodeError(f"task {task.task_id}: bad params at '{loc}': {err['msg']}") from None


class MathEnvironment(Environment[MathState]):
    """Small-integer arithmetic: ``+``, ``-`` and ``*``."""

    name: ClassVar[str] = "math"
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.RESTART_ONLY

    def _make_task(self, index: int, rng: random.Random) -> TaskRow:
        op = rng.choice(("+", "-", "*"))
        a, b = (rng.randint(2, 99), rng.randint(2, 99)) if op != "*" else _factors(rng)
        params = MathParams(a=a, b=b, op=op, answer=_APPLY[op](a, b))
        return TaskRow(
            task_id=self.task_id(index),
            environment="math",
            prompt=math_prompt(a, op, b),
            params=params.model_dump(mode="json"),
        )

    def start(self, task: TaskRow) -> MathState:
        _params(task)
        return MathState()

    def verify(self, state: MathState, task: TaskRow, final_message: str | None) -> VerifyReply:
        expected = _params(task).answer
        given = last_integer(final_message) if final_message is not None else None
        reward = 1.0 if given == expected else 0.0
        return VerifyReply(reward=reward, detail={"expected": expected, "given": given})

    def export_state(self, state: MathState) -> dict[str, JsonValue]:
        return {}

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> MathState:
        if exported:
            raise InvalidCheckpointStateError(
                f"math state of task {task.task_id}: want an empty object, got keys {sorted(exported)}"
            )
        return self.start(task)


def _factors(rng: random.Random) -> tuple[int, int]:
    return rng.randint(2, 30), rng.randint(2, 30)
