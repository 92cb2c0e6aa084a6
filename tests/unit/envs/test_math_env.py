"""The math environment: single turn, no tools, restart-only."""

from __future__ import annotations

import operator
import re

import pytest

from rollpoint.envs.base import ToolArgumentError
from rollpoint.envs.math import MathEnvironment, last_integer
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import EpisodeError, InvalidCheckpointStateError
from rollpoint.protocol.participant import CheckpointMode

PROMPT = re.compile(r"^What is (\d+) ([+*-]) (\d+)\? Answer with the number only\.$")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
env = MathEnvironment()


def task(a: int, op: str, b: int, answer: int) -> TaskRow:
    return TaskRow(
        task_id="math-x",
        environment="math",
        prompt=f"What is {a} {op} {b}? Answer with the number only.",
        params={"a": a, "b": b, "op": op, "answer": answer},
    )


def test_tasks_are_deterministic_and_their_prompts_hold_the_question() -> None:
    tasks = env.make_tasks(60, seed=2)
    assert tasks == env.make_tasks(60, seed=2)
    assert tasks != env.make_tasks(60, seed=3)
    assert tasks[0].task_id == "math-0000"
    ops = set()
    for t in tasks:
        m = PROMPT.match(t.prompt)
        assert m is not None, t.prompt
        a, op, b = int(m[1]), m[2], int(m[3])
        assert t.params == {"a": a, "b": b, "op": op, "answer": OPS[op](a, b)}
        ops.add(op)
    assert ops == {"+", "-", "*"}


def test_is_restart_only_with_no_tools() -> None:
    assert env.checkpoint_mode is CheckpointMode.RESTART_ONLY
    assert env.tools() == []
    with pytest.raises(ToolArgumentError, match=r"unknown tool 'calc' \(available tools: none\)"):
        env.call(env.start(task(2, "+", 2, 4)), "calc", {})


@pytest.mark.parametrize(
    ("final", "reward"),
    [
        ("391", 1.0),
        ("The answer is 391.", 1.0),
        ("17 * 23 = 391", 1.0),
        ("390", 0.0),
        ("three hundred ninety-one", 0.0),
        ("", 0.0),
        (None, 0.0),
    ],
)
def test_verify_reads_the_last_integer(final: str | None, reward: float) -> None:
    t = task(17, "*", 23, 391)
    assert env.verify(env.start(t), t, final).reward == reward


def test_verify_handles_negative_answers_and_digit_grouping() -> None:
    t = task(5, "-", 17, -12)
    assert env.verify(env.start(t), t, "5 - 17 = -12").reward == 1.0
    assert last_integer("It is 9,801.") == 9801
    assert last_integer("1, 2, 3") == 3


def test_export_is_empty_and_restore_gives_a_fresh_episode() -> None:
    t = task(2, "+", 3, 5)
    exported = env.export_state(env.start(t))
    assert exported == {}
    assert env.verify(env.restore_state(t, exported), t, "5").reward == 1.0
    with pytest.raises(InvalidCheckpointStateError, match="want an empty object"):
        env.restore_state(t, {"x": 1})


def test_a_task_whose_answer_is_wrong_is_refused() -> None:
    with pytest.raises(EpisodeError, match="answer 6 is not 2 \\+ 3"):
        env.start(task(2, "+", 3, 6))
