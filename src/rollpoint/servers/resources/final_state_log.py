"""The final-state log: every verified episode's environment state, as the server held it.

Owns one JSONL file per resources server (``<folder>/resources-<replica>.jsonl``, the
folder is the run's ``final_states_log``) and reading such folders back. A line is written
when an episode is verified, before the verify reply leaves, so a reward the trainer saw
always has its line (a process killed after the write keeps it: the line goes to the kernel
unbuffered, in as many ``write`` calls as the kernel asks for). A process killed *during*
the write leaves a torn last line with no newline; its verify never replied, so the line
stands for nothing: the next server to open the file cuts it off (and says so), and a
reader skips a torn last line. Any other line that does not parse is named. It holds the rollout, the attempt, the task and the
environment's own export of the state (``Environment.export_state``: for ``workplace``
the whole SQLite database), which is what exactly-once tool effects are counted from
(``rollpoint chaos``, invariant I2) instead of transcripts or rewards.

An audit, off by default: a verify then costs one export and one write on the event loop.
The folder is local to the node the server runs on. It does not judge anything: the
checker (:mod:`rollpoint.testing.invariants`) does.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from pydantic import JsonValue

from rollpoint.protocol.errors import ConfigError
from rollpoint.protocol.ids import EpisodeId

FILE_PATTERN = "resources-*.jsonl"

logger = logging.getLogger(__name__)
_TAIL_PROBE = 64 * 1024  # bytes read from the end to find the last newline


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
    ts: float = 0.0
    """Unix time the server wrote the line."""


class FinalStateLog:
    """The log one resources server appends to."""

    def __init__(self, folder: Path, replica: str) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.path = folder / f"resources-{replica}.jsonl"
            # Unbuffered: each line is in the kernel when verify replies.
            self._file: BinaryIO = self.path.open("ab", buffering=0)
            self._cut_torn_tail()
        except OSError as exc:
            raise ConfigError(f"final_states_log {folder}: {exc.strerror or exc}") from None

    def _cut_torn_tail(self) -> None:
        """Cut off the line an earlier server was killed in the middle of writing, so this
        server's lines do not run on from it (that verify never replied)."""
        size = os.fstat(self._file.fileno()).st_size
        if size == 0:
            return
        with self.path.open("rb") as reader:
            reader.seek(size - 1)
            if reader.read(1) == b"\n":
                return
            # Read back, a block at a time, to the newline before the torn line.
            start, tail = size, b""
            while start > 0 and b"\n" not in tail:
                start = max(0, start - _TAIL_PROBE)
                reader.seek(start)
                tail = reader.read(size - start)
        keep = start + tail.rfind(b"\n") + 1  # 0 when the whole file is one torn line
        os.truncate(self.path, keep)
        logger.warning(
            "final_states_log %s: cut off a line torn by a kill (%d bytes)",
            self.path,
            size - keep,
        )

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
        data = memoryview(orjson.dumps(line) + b"\n")
        while data:  # a raw write may take only part of a large line
            written = self._file.write(data)
            data = data[written or 0 :]

    def close(self) -> None:
        self._file.close()


def read_final_states(folder: Path) -> tuple[dict[tuple[str, int], FinalState], list[str]]:
    """Every verified episode's last line in ``folder`` by (rollout id, attempt), and the
    lines that could not be read. A torn last line (no newline: its writer was killed in
    the write, before the verify replied) is skipped; any other bad line is named, never
    guessed at.

    "Last" is the line written last (its ``ts``), whichever replica's file holds it: a try
    can be verified on two replicas. A row queued in the snapshot a rerun restores keeps
    its rollout id and attempt, and may have been sent to one replica after that snapshot
    (and verified there) and to another by the rerun; the rerun's verify is the one trained.
    Lines of one file keep their order when their times are equal."""
    found: dict[tuple[str, int], FinalState] = {}
    unreadable: list[str] = []
    for path in sorted(folder.glob(FILE_PATTERN)):
        content = path.read_bytes()
        if not content.endswith(b"\n"):
            content = content[: content.rfind(b"\n") + 1]
        for number, raw in enumerate(content.splitlines(), start=1):
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
                    ts=float(doc["ts"]),
                )
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                unreadable.append(f"{path.name} line {number}: {exc}")
                continue
            key = (entry.rollout_id, entry.attempt)
            kept = found.get(key)
            if kept is None or entry.ts >= kept.ts:
                found[key] = entry
    return found, unreadable
