"""The final-state log: every verified episode's environment state, as the server held it.

Owns one JSONL file per resources server (``<folder>/resources-<replica>.jsonl``, the
folder is the run's ``final_states_log``) and reading such folders back. A line is written
when an episode is verified, before the verify reply leaves, so a reward the trainer saw
always has its line (a process killed after the write keeps it: the write is a single
unbuffered ``write`` to the kernel). It holds the rollout, the attempt, the task and the
environment's own export of the state (``Environment.export_state``: for ``workplace``
the whole SQLite database), which is what exactly-once tool effects are counted from
(``rollpoint chaos``, invariant I2) instead of transcripts or rewards.

An audit, off by default: a verify then costs one export and one write on the event loop.
The folder is local to the node the server runs on. It does not judge anything: the
checker (:mod:`rollpoint.testing.invariants`) does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from pydantic import JsonValue

from rollpoint.protocol.errors import ConfigError
from rollpoint.protocol.ids import EpisodeId

FILE_PATTERN = "resources-*.jsonl"


@dataclass(frozen=True)
class FinalState:
    """One verified episode's line."""

    rollout_id: str
    attempt: int
    task_id: str
    environment: str
    state: dict[str, Any]
    file: Path
    line: int


class FinalStateLog:
    """The log one resources server appends to."""

    def __init__(self, folder: Path, replica: str) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.path = folder / f"resources-{replica}.jsonl"
            # Unbuffered: each line is one write, in the kernel when verify replies.
            self._file: BinaryIO = self.path.open("ab", buffering=0)
        except OSError as exc:
            raise ConfigError(f"final_states_log {folder}: {exc.strerror or exc}") from None

    def append(
        self,
        episode: EpisodeId,
        task_id: str,
        environment: str,
        state: dict[str, JsonValue],
    ) -> None:
        line = {
            "ts": time.time(),
            "rollout_id": episode.rollout_id,
            "attempt": episode.attempt,
            "task_id": task_id,
            "environment": environment,
            "state": state,
        }
        self._file.write(orjson.dumps(line) + b"\n")

    def close(self) -> None:
        self._file.close()


def read_final_states(folder: Path) -> tuple[dict[tuple[str, int], FinalState], list[str]]:
    """Every verified episode's last line in ``folder`` by (rollout id, attempt), and the
    lines that could not be read (a line torn by a kill is named, never guessed at)."""
    found: dict[tuple[str, int], FinalState] = {}
    unreadable: list[str] = []
    for path in sorted(folder.glob(FILE_PATTERN)):
        for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
            try:
                doc = orjson.loads(raw)
                entry = FinalState(
                    rollout_id=str(doc["rollout_id"]),
                    attempt=int(doc["attempt"]),
                    task_id=str(doc["task_id"]),
                    environment=str(doc["environment"]),
                    state=dict(doc["state"]),
                    file=path,
                    line=number,
                )
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                unreadable.append(f"{path.name} line {number}: {exc}")
                continue
            found[(entry.rollout_id, entry.attempt)] = entry
    return found, unreadable
