"""``rollpoint conformance --environment`` (issue 36 item 6): an environment's own promises
pass on environments that keep them, and each check fails on one that breaks it."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import JsonValue

from rollpoint.envs import (
    CheckpointMode,
    Environment,
    NoArguments,
    TaskRow,
    Tool,
    ToolContext,
    VerifyReply,
    slow_tool,
)
from rollpoint.testing.environment_conformance import (
    check_environment,
    environment_conformance_command,
)
from tests.support.ledger_env import LEDGER_ENV, LedgerEnvironment

OUTSIDE: list[str] = []


@dataclass
class Tally:
    count: int = 0
    notes: list[str] = field(default_factory=list)


def _bump(state: Tally, args: NoArguments) -> str:
    state.count += 1
    return f"count {state.count}"


class TallyEnvironment(Environment[Tally]):
    name: ClassVar[str] = "tally"
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.TURN

    def _make_task(self, index: int, rng: random.Random) -> TaskRow:
        return TaskRow(task_id=self.task_id(index), environment=self.name, prompt="bump")

    def tool_table(self) -> Mapping[str, Tool[Tally, Any]]:
        return {"bump": Tool("bump", "Bump.", NoArguments, _bump)}

    def start(self, task: TaskRow) -> Tally:
        return Tally()

    def verify(self, state: Tally, task: TaskRow, final_message: str | None) -> VerifyReply:
        return VerifyReply(reward=1.0)

    def export_state(self, state: Tally) -> dict[str, JsonValue]:
        return {"count": state.count, "notes": list(state.notes)}

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> Tally:
        return Tally(exported["count"], list(exported["notes"]))


class LossyRestore(TallyEnvironment):
    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> Tally:
        return Tally(0)  # forgets the count


class Dice(TallyEnvironment):
    def tool_table(self) -> Mapping[str, Tool[Tally, Any]]:
        def roll(state: Tally, args: NoArguments) -> str:
            return str(random.random())  # not from the state: a replay differs

        return {"roll": Tool("roll", "Roll.", NoArguments, roll)}


class Mailer(TallyEnvironment):
    """Sends outside without ctx.effect and ignores replaying(): a replay sends again."""

    def tool_table(self) -> Mapping[str, Tool[Tally, Any]]:
        @slow_tool
        def send(state: Tally, args: NoArguments, ctx: ToolContext) -> str:
            OUTSIDE.append(ctx.idempotency_key)
            return "sent"

        return {"send": Tool("send", "Send.", NoArguments, send)}

    def side_effects(self, state: Tally) -> Counter[str]:
        return Counter(OUTSIDE)


class GoodLedger(LedgerEnvironment):
    """The ledger's tools that make their effect through ctx.effect (not its broken ones)."""

    def tool_table(self) -> Mapping[str, Tool[Any, Any]]:
        return {k: v for k, v in super().tool_table().items() if k in ("post", "apost")}


@pytest.fixture(autouse=True)
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ledger.jsonl"))
    OUTSIDE.clear()


@pytest.mark.parametrize("env", [TallyEnvironment(), GoodLedger()], ids=["tally", "ledger"])
def test_an_environment_that_keeps_its_promises_passes_every_check(env: Environment[Any]) -> None:
    checks = check_environment(env, episodes=2, calls=5)
    assert {c.name for c in checks} == {"export/restore", "replay", "side effects"}
    assert all(c.passed for c in checks), [c.line() for c in checks if not c.passed]


@pytest.mark.parametrize(
    ("env", "check", "said"),
    [
        (LossyRestore(), "export/restore", "the restored state exports differently"),
        (Dice(), "replay", "call 0 (roll) gave another result"),
        (Mailer(), "side effects", "counted twice"),
    ],
    ids=["lossy-restore", "non-deterministic", "effect-outside-ctx"],
)
def test_each_check_fails_on_the_environment_that_breaks_it(
    env: Environment[Any], check: str, said: str
) -> None:
    failed = [c for c in check_environment(env, episodes=1, calls=3) if not c.passed]
    assert [c.name for c in failed] == [check], [c.line() for c in failed]
    assert said in failed[0].detail


def test_a_tool_that_raises_fails_its_episode_with_one_line() -> None:
    (failed,) = [
        c for c in check_environment(LedgerEnvironment(), episodes=1, calls=8) if not c.passed
    ]
    assert failed.name == "episode" and "\n" not in failed.detail


def test_the_command_exits_1_on_a_failure_and_2_on_an_unknown_environment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert environment_conformance_command("workplace", episodes=1, calls=3) == 0
    assert "3 passed, 0 failed (workplace)" in capsys.readouterr().out
    ref = f"{__name__}:LossyRestore"
    assert environment_conformance_command(ref, episodes=1, calls=3) == 1
    assert environment_conformance_command("no_such_env") == 2
    assert "unknown environment 'no_such_env'" in capsys.readouterr().err
