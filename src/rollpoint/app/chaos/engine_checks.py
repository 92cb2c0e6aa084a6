"""What a chaos trial's engine-data faults must leave behind (issue 33, items 5-6).

Owns the checks the runner adds after a trial in which the scripted policy corrupted a
call (``oversized_reply``, ``bad_token_data``, ``tool_call_without_id``: see
:mod:`rollpoint.app.chaos.plan`), read from the trial's folder:

- **nothing bad was trained**: no line of ``train_data.jsonl`` holds the oversized
  reply's padding, a token id that is not an int in ``[0, 2**31)``, a logprob that is not
  a float <= 0, or an assistant tool call without an id (I1: the row reached training
  with the engine's corrupted reply);
- **the failure was reported and the row re-sent**: in a run that finished with no other
  fault of its own (another fault may fail the same row first, for its own reason), the
  trainer's log has, for every corruption the policy logged, the re-send of its row with
  the reason naming the size and the cap (``… (N bytes) cap (max_reply_bytes): re-sending
  it fresh``) or the engine and the field (``vllm reply: chunk choices[0].token_ids[3] is
  not a token id: '13'``, in the line that re-sends the row) (I1).

Every row trained exactly once is I1's own check (:mod:`rollpoint.testing.invariants`).
It runs nothing and applies no fault.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import orjson

from rollpoint.app.chaos.plan import ENGINE_DATA, TrialPlan, engine_fault_log
from rollpoint.app.chaos.tally import RunRecord
from rollpoint.protocol.engine_faults import PADDING
from rollpoint.testing.invariants import Invariant, Violation
from rollpoint.trainer.record.workdir_record import TRAIN_DATA_FILE

TRAINER_LOG = "rollpoint.log"
_INT32_LIMIT = 2**31
_RESENT = ("re-sending it fresh", "re-sending under new rollout ids")
"""What the dispatcher's line says as it re-sends a failed try (fresh, or given up)."""


def check_engine_data(
    plan: TrialPlan, runs: list[RunRecord], *, engine: str, cap: int
) -> list[Violation]:
    """The trial's engine-data violations (none when no such fault took effect);
    ``engine``: ``policy.engine``; ``cap``: the trial's ``max_reply_bytes``."""
    struck = [e for r in runs for e in r.events if e.event == "fault" and e.kind in ENGINE_DATA]
    if not struck:
        return []
    found = _nothing_bad_trained(plan.workdir / TRAIN_DATA_FILE)
    log_path = plan.workdir / TRAINER_LOG
    log = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    for run in runs:
        others = [f for f in plan.faults if f.run == run.run and f.kind not in ENGINE_DATA]
        if run.returncode != 0 or others:
            continue
        this = plan.model_copy(update={"run": run.run})
        for line in fault_log_lines(engine_fault_log(this)):
            words = _reported_as(line, engine, cap)
            if not any(words in said and any(r in said for r in _RESENT) for said in log):
                found.append(
                    Violation(
                        Invariant.EXACTLY_ONCE,
                        f"run {run.run} policy call {line.get('call')} ({line.get('corrupt')})",
                        f"its row was not re-sent naming the fault: no line of {TRAINER_LOG} "
                        f"re-sends a row saying {words!r}",
                    )
                )
    return found


def _reported_as(line: dict[str, Any], engine: str, cap: int) -> str:
    """The words the dispatcher's re-send line must hold for one logged corruption."""
    if line.get("corrupt") == "oversized_reply":
        return f"({cap} bytes) cap (max_reply_bytes)"
    return f"{engine} reply: chunk {line.get('field')}"


def _nothing_bad_trained(path: Path) -> list[Violation]:
    if not path.exists():
        return []  # I1's own check says so
    found = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            row = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue  # I1's own check says so
        problem = _bad_in(row)
        if problem:
            found.append(
                Violation(
                    Invariant.EXACTLY_ONCE,
                    f"{TRAIN_DATA_FILE} line {number}",
                    f"trained with the engine's corrupted reply: {problem}",
                )
            )
    return found


def _bad_in(row: dict[str, Any]) -> str:
    """What of a trained row is engine data rollpoint must have refused ("": nothing)."""
    for m, message in enumerate(row.get("messages") or ()):
        content = message.get("content")
        if isinstance(content, str) and PADDING in content:
            return f"messages[{m}] holds the oversized reply's padding"
        for c, call in enumerate(message.get("tool_calls") or ()):
            if not (isinstance(call.get("id"), str) and call["id"]):
                return f"messages[{m}].tool_calls[{c}] has no id"
    turns = row.get("turns")
    for t, turn in enumerate(turns if isinstance(turns, list) else ()):
        for field in ("completion_token_ids", "prompt_token_ids"):
            ids = turn.get(field) or ()
            if not all(type(i) is int and 0 <= i < _INT32_LIMIT for i in ids):
                return f"turns[{t}].{field} holds a bad token id"
        logprobs = turn.get("completion_logprobs") or ()
        if not all(type(lp) is float and lp <= 0 for lp in logprobs):
            return f"turns[{t}].completion_logprobs holds a bad logprob"
    return ""


def fault_log_lines(path: Path) -> list[dict[str, Any]]:
    """The corruptions the scripted policy logged in ``path`` so far (a file it may still
    append to: a torn last line is left for later)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = []
    for line in raw.splitlines():
        with contextlib.suppress(orjson.JSONDecodeError):
            lines.append(orjson.loads(line))
    return lines
