"""An environment whose one effect is a line in an outside ledger file, made through
``ctx.effect``: what a payment or ticket API is to a real environment.

``post(amount)`` (a slow tool: it runs in a worker thread) appends ``{"key", "amount"}`` to
the file ``$ROLLPOINT_TEST_LEDGER`` names and keeps the line number as the receipt the
episode's state records; ``apost`` is the same as an ``async def`` tool. Counting the
ledger's lines by key is counting the effects the outside world saw.

``$ROLLPOINT_TEST_LEDGER_FAIL`` set: ``fn`` writes the line and then raises (the outside
system applied the effect but its reply was lost): the effect is left in doubt.
:class:`ReconcilingLedger` looks an in-doubt effect up in the ledger by its key.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson
from pydantic import JsonValue

from rollpoint.envs.base import Environment, Tool, ToolArguments
from rollpoint.envs.effects import InDoubtEffect, Reconciled
from rollpoint.envs.tool_call import ToolContext, slow_tool
from rollpoint.protocol.episode import TaskRow, VerifyReply
from rollpoint.protocol.participant import CheckpointMode

LEDGER_ENV = "ROLLPOINT_TEST_LEDGER"
FAIL_ENV = "ROLLPOINT_TEST_LEDGER_FAIL"


class Amount(ToolArguments):
    amount: int


@dataclass
class LedgerState:
    receipts: list[int] = field(default_factory=list)


def ledger_lines() -> list[dict[str, Any]]:
    path = os.environ[LEDGER_ENV]
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        return [orjson.loads(line) for line in f.read().splitlines()]


def _append(key: str, amount: int) -> int:
    with open(os.environ[LEDGER_ENV], "ab") as f:
        f.write(orjson.dumps({"key": key, "amount": amount}) + b"\n")
        f.flush()
        receipt = f.tell()
    if os.environ.get(FAIL_ENV):
        raise ConnectionResetError("the ledger's reply was lost")
    return receipt


@slow_tool
def _post(state: LedgerState, args: Amount, ctx: ToolContext) -> str:
    receipt = ctx.effect("ledger_post", lambda key: _append(key, args.amount))
    state.receipts.append(receipt)
    return f"posted {args.amount}: receipt {receipt}"


async def _apost(state: LedgerState, args: Amount, ctx: ToolContext) -> str:
    async def post(key: str) -> int:
        return _append(key, args.amount)

    receipt = await ctx.aeffect("ledger_post", post)
    state.receipts.append(receipt)
    return f"posted {args.amount}: receipt {receipt}"


def _on_loop(state: LedgerState, args: Amount, ctx: ToolContext) -> str:
    return str(ctx.effect("ledger_post", lambda key: _append(key, args.amount)))


def _undeclared(state: LedgerState, args: Amount, ctx: ToolContext) -> str:
    return str(ctx.effect("refund", lambda key: _append(key, -args.amount)))


class LedgerEnvironment(Environment[LedgerState]):
    name: ClassVar[str] = "ledger"
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.TURN
    effects: ClassVar[frozenset[str]] = frozenset({"ledger_post"})

    def _make_task(self, index: int, rng: random.Random) -> TaskRow:
        return TaskRow(task_id=self.task_id(index), environment=self.name, prompt="post 5")

    def tool_table(self) -> Mapping[str, Tool[LedgerState, Any]]:
        return {
            "post": Tool("post", "Post an amount.", Amount, _post),
            "apost": Tool("apost", "Post an amount.", Amount, _apost),
            "on_loop": Tool("on_loop", "Post, on the event loop.", Amount, _on_loop),
            "refund": Tool("refund", "An undeclared effect.", Amount, _undeclared),
        }

    def start(self, task: TaskRow) -> LedgerState:
        return LedgerState()

    def verify(self, state: LedgerState, task: TaskRow, final_message: str | None) -> VerifyReply:
        return VerifyReply(reward=1.0 if state.receipts else 0.0)

    def export_state(self, state: LedgerState) -> dict[str, JsonValue]:
        return {"receipts": list(state.receipts)}

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> LedgerState:
        return LedgerState(list(exported["receipts"]))

    def side_effects(self, state: LedgerState) -> Counter[str]:
        return Counter(f"receipt:{r}" for r in state.receipts)


class ReconcilingLedger(LedgerEnvironment):
    """Decides an in-doubt post by looking its key up in the ledger."""

    def reconcile(self, state: LedgerState, effect: InDoubtEffect) -> Reconciled | None:
        offset = 0
        for line in ledger_lines():
            offset += len(orjson.dumps(line)) + 1
            if line["key"] == effect.key:
                return Reconciled.applied(offset)
        return Reconciled.not_applied()
