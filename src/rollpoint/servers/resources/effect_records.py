"""Where a resources server records effects: one small durable file per effect in the
snapshot store, shared by every replica.

Owns the :class:`~rollpoint.envs.effects.EffectStore` of resources servers that have a
local snapshot store: ``<store>/effects/<rollout>/t<turn>-c<call>-<name>.json``, holding

- ``{"effect", "key", "tool", "attempt", "state": "intent"}`` — written, and durable (the
  file and its folder fsynced), before ``fn`` runs;
- ``{"effect", "key", "tool", "attempt", "state": "result", "result", "reconciled"}`` —
  written over it (a new file renamed into place, fsynced) after ``fn`` returned, or after
  ``reconcile`` said the effect was made.

A file whose state is ``intent`` is an effect *in doubt* (:mod:`rollpoint.envs.effects`).

**Why files in the store, not the server's journal.** A journal has one writer: each
resources server has its own (``journal/resources/<name>-<replica>``). An episode is not
bound to one: a row sent again after a crash, or after its replica was lost, may be played
by another replica, which would not find the effect in its own journal and would make it a
second time (the sandbox crash test saw exactly that with two replicas). Effects are the
one record whose loss is not a lost optimisation but a duplicate in the outside world, so
they are kept where every replica looks them up by name: one file per effect, read with one
``open``. The cost is two small fsynced writes per effect (no group commit); effects are the
calls that reach an outside system, which takes longer than that.

**Why they are kept with ``journal.enabled`` off.** ``ctx.effect`` is the environment
author's promise that an effect is made once, written in code; the journal switch is an
operator's trade-off about the recovery point of turns. Turning the second off must not
quietly make the first "at least once". An environment declares its effects
(``Environment.effects``), so a server knows at start that it needs a local store, and one
without (an fsspec URL) refuses to start, naming the environment.

Retention: the files of a run stay until the store is removed (one per effect made).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import orjson
from pydantic import JsonValue

from rollpoint.envs.effects import EffectCall, Recorded

EFFECTS_DIR = "effects"
INTENT = "intent"
RESULT = "result"


def effects_folder(store_root: str) -> Path:
    return Path(store_root) / EFFECTS_DIR


class EffectRecords:
    """Effects recorded under one snapshot store's ``effects/`` folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, call: EffectCall) -> Path:
        # Rollout ids are identifiers and names are checked (check_effect_name): no '/'.
        return self.folder / call.rollout_id / f"t{call.turn}-c{call.call_index}-{call.name}.json"

    def read(self, call: EffectCall) -> dict[str, Any] | None:
        try:
            data = self._path(call).read_bytes()
        except FileNotFoundError:
            return None
        value: dict[str, Any] = orjson.loads(data)
        return value

    def in_doubt(self) -> list[str]:
        """The keys of every effect recorded as an intent only (for reports and tests)."""
        found = []
        for path in sorted(self.folder.glob("*/*.json")):
            value = orjson.loads(path.read_bytes())
            if value["state"] == INTENT:
                found.append(str(value["key"]))
        return found

    def _write(self, call: EffectCall, value: dict[str, Any]) -> None:
        path = self._path(call)
        if not path.parent.exists():
            # A new folder's entry is durable only once its parent is fsynced (each new one).
            new = [p for p in (self.folder, path.parent) if not p.exists()]
            path.parent.mkdir(parents=True, exist_ok=True)
            for folder in new:
                _fsync_dir(folder.parent)
        staged = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, orjson.dumps(value))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(staged, path)
        _fsync_dir(path.parent)

    def _value(self, call: EffectCall, state: str) -> dict[str, Any]:
        return {
            "effect": call.name,
            "key": call.key,
            "tool": call.tool,
            "attempt": call.attempt,
            "state": state,
        }

    # ---- the EffectStore, on the server's event loop (the file work in a thread) ----------
    async def find(self, call: EffectCall) -> Recorded | None:
        value = await asyncio.to_thread(self.read, call)
        if value is None:
            return None
        if value["state"] == RESULT:
            return Recorded(True, value["result"])
        return Recorded(False)

    async def intent(self, call: EffectCall) -> None:
        await asyncio.to_thread(self._write, call, self._value(call, INTENT))

    async def result(self, call: EffectCall, result: JsonValue, *, reconciled: bool) -> None:
        value = {**self._value(call, RESULT), "result": result, "reconciled": reconciled}
        await asyncio.to_thread(self._write, call, value)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
