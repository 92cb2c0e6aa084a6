"""The ``shell_sandbox`` environment: shell commands in a working directory per episode,
state that lives outside rollpoint, and an audit log the outside world keeps.

Modelled on coding-agent sandboxes. Each episode has a folder ``<root>/<rollout_id>/``
(``$SHELL_SANDBOX_ROOT``, else ``<tmp>/rollpoint-shell-sandbox``) that outlives the
resources server: a crash does not take it away, as it would not take away a container.
The one tool, ``run(script)``, runs one of the task's scripts with ``bash`` in the
episode's ``work/`` folder, as a process tree of its own (a new session: ``bash`` and the
processes it starts; killed as a group on timeout). Scripts sleep ``$SHELL_SANDBOX_STEP_S``
seconds (default 1) as a build or a test suite would, so ``run`` is a ``@slow_tool``.

Checkpointing: ``external`` mode. Nothing of the folder is exported; :meth:`version` is
``"<calls applied> <digest>"``, read from the folder's ``version`` file, which ``run``
advances *before* it starts the command: a call cut short by a crash leaves a version no
journal record names, so the episode restarts rather than continue on state it cannot
vouch for. :meth:`attach` finds the folder of a rollout again after a crash.

The outside effect: after each command, ``run`` appends one line to the audit log
(``$SHELL_SANDBOX_LOG``, else ``<root>/audit.jsonl``) through ``ctx.effect("audit", ...)``,
keyed by the effect's idempotency key: journaled before and after, never written twice for
one call. :meth:`reconcile` decides an audit line in doubt by looking its key up in the log.

Uses only rollpoint's public API (``rollpoint.envs``).
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import orjson
from pydantic import JsonValue

from rollpoint.envs import (
    CheckpointMode,
    Environment,
    InDoubtEffect,
    InvalidCheckpointStateError,
    Reconciled,
    TaskRow,
    Tool,
    ToolArguments,
    ToolContext,
    VerifyReply,
    slow_tool,
)

SCRIPTS: dict[str, str] = {
    # Each leaves its mark in the folder; sleeps are in a child process (a tree, not one pid).
    "build": 'mkdir -p out && (sleep "$STEP") && echo "build $(date +%s%N)" >> out/build.log'
    " && wc -l < out/build.log",
    "test": '(sleep "$STEP") && if [ -s out/build.log ]; then echo PASS; else echo FAIL; fi'
    " | tee out/test.result",
    "fix": 'echo "fixed" >> src.txt && (sleep "$STEP") && wc -l < src.txt',
    "status": "ls -1 . out 2>/dev/null; cat out/test.result 2>/dev/null || true",
}
TIMEOUT_S = 60.0
"""A script still running after this is killed with its whole process group."""


class RunArgs(ToolArguments):
    script: Literal["build", "test", "fix", "status"]


@dataclass
class ShellState:
    """A handle on one episode's folder (made on its first call: ``start`` does not know
    the rollout)."""

    task_id: str
    folder: Path | None = None


def _root() -> Path:
    configured = os.environ.get("SHELL_SANDBOX_ROOT")
    root = (
        Path(configured) if configured else Path(tempfile.gettempdir()) / "rollpoint-shell-sandbox"
    )
    root.mkdir(parents=True, exist_ok=True)
    return root


def audit_log() -> Path:
    """The outside world's append-only log of effects."""
    configured = os.environ.get("SHELL_SANDBOX_LOG")
    return Path(configured) if configured else _root() / "audit.jsonl"


def audit_lines() -> list[dict[str, Any]]:
    path = audit_log()
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def _read_version(folder: Path | None) -> str:
    if folder is None or not (folder / "version").exists():
        return "0 start"
    return (folder / "version").read_text().strip()


def _write_version(folder: Path, version: str) -> None:
    staged = folder / "version.new"
    staged.write_text(version + "\n")
    os.replace(staged, folder / "version")


def _run_script(work: Path, script: str) -> str:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "STEP": os.environ.get("SHELL_SANDBOX_STEP_S", "1"),
        "HOME": str(work),
    }
    proc = subprocess.Popen(
        ["bash", "-c", SCRIPTS[script]],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the whole tree is killed together
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return f"killed after {TIMEOUT_S:g}s\n{out.decode(errors='replace')[-2000:]}"
    return f"exit {proc.returncode}\n{out.decode(errors='replace')[-2000:]}"


def _append_audit(key: str, line: dict[str, Any]) -> int:
    data = orjson.dumps({"key": key, **line}) + b"\n"
    fd = os.open(audit_log(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)  # one write with O_APPEND: lines of concurrent episodes never mix
    finally:
        os.close(fd)
    return int(line["call"])


@slow_tool
def _run(state: ShellState, args: RunArgs, ctx: ToolContext) -> str:
    if state.folder is None:
        # The episode's first call: a folder already there is an earlier try's of the same
        # rollout that this one does not continue (rollpoint attaches those it continues).
        state.folder = _root() / ctx.rollout_id
        shutil.rmtree(state.folder, ignore_errors=True)
        (state.folder / "work").mkdir(parents=True)
    calls, digest = _read_version(state.folder).split(" ")
    # The version moves first: a crash during the command leaves a version no journal
    # record names, and the episode is not continued on that folder.
    step = int(calls) + 1
    new_digest = hashlib.sha256(
        f"{digest} {ctx.idempotency_key} {args.script}".encode()
    ).hexdigest()
    _write_version(state.folder, f"{step} {new_digest[:16]}")
    out = _run_script(state.folder / "work", args.script)
    ctx.effect(
        "audit",
        lambda key: _append_audit(
            key,
            {"rollout": ctx.rollout_id, "task": state.task_id, "script": args.script, "call": step},
        ),
    )
    return out


class ShellSandbox(Environment[ShellState]):
    """Shell scripts in a folder per episode that outlives the server; reward: tests pass."""

    name: ClassVar[str] = "shell_sandbox"
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.EXTERNAL
    effects: ClassVar[frozenset[str]] = frozenset({"audit"})

    def _make_task(self, index: int, rng: random.Random) -> TaskRow:
        first = rng.choice(("build", "fix"))
        return TaskRow(
            task_id=self.task_id(index),
            environment=self.name,
            prompt=f"Run {first}, then build and test until the tests pass.",
        )

    def tool_table(self) -> Mapping[str, Tool[ShellState, Any]]:
        return {"run": Tool("run", "Run one of the project's scripts.", RunArgs, _run)}

    def start(self, task: TaskRow) -> ShellState:
        return ShellState(task.task_id)

    def verify(self, state: ShellState, task: TaskRow, final_message: str | None) -> VerifyReply:
        result = None if state.folder is None else state.folder / "work" / "out" / "test.result"
        passed = result is not None and result.exists() and result.read_text().strip() == "PASS"
        return VerifyReply(reward=1.0 if passed else 0.0, detail={"version": self.version(state)})

    # ---- state outside ----------------------------------------------------------------
    def version(self, state: ShellState) -> str:
        return _read_version(state.folder)

    def attach(self, task: TaskRow, rollout_id: str) -> ShellState | None:
        folder = _root() / rollout_id
        if not folder.exists():
            # No call ever made one: the episode is at its start ("0 start").
            return ShellState(task.task_id)
        return ShellState(task.task_id, folder)

    def export_state(self, state: ShellState) -> dict[str, JsonValue]:
        # What the final-state log keeps: the state itself is outside.
        return {"version": self.version(state)}

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> ShellState:
        raise InvalidCheckpointStateError(
            f"shell_sandbox (task {task.task_id}): external state is attached, never restored"
        )

    def reconcile(self, state: ShellState, effect: InDoubtEffect) -> Reconciled | None:
        for line in audit_lines():
            if line["key"] == effect.key:
                return Reconciled.applied(line["call"])
        return Reconciled.not_applied()

    def side_effects(self, state: ShellState) -> Counter[str]:
        if state.folder is None:
            return Counter()
        rollout = state.folder.name
        return Counter(line["key"] for line in audit_lines() if line["rollout"] == rollout)

    def close(self, state: ShellState) -> None:
        # A handle closes; the folder stays, as a stopped container would until its owner
        # removes it: a handle replaced by a restore's attached one names the same folder.
        pass

    @staticmethod
    def remove(rollout_id: str) -> None:
        """Delete a rollout's folder (an operator's clean-up; rollpoint never calls it)."""
        shutil.rmtree(_root() / rollout_id, ignore_errors=True)
