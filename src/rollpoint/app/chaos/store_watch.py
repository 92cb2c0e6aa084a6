"""A trial's snapshot store watched from outside its process while a run goes.

Owns the two moments the runner's kills wait for there: the snapshots a run publishes
(:class:`Published`, for ``PlannedFault.after_snapshots`` and a pack damage's fallback),
and a journal group commit under way (:func:`journal_commit`, for a
``journal_commit_kill``). Both are polled: the store is written by another process, with
no event the runner could await.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import orjson

from rollpoint.app.chaos.launch import LiveRun
from rollpoint.app.chaos.plan import COMMIT_WAIT_S

__all__ = ["Published", "journal_commit"]

_PUBLISHED_POLL_S = 0.05
_COMMIT_POLL_S = 0.0005


async def journal_commit(store: Path, live: LiveRun) -> bool:
    """Return True as soon as a journal segment in ``store`` grows (a group commit's
    records are being written), or a new one appears; False after :data:`COMMIT_WAIT_S`,
    or once the run has ended. Polled (``stat``), not awaited: the kill must land within
    the commit's write and fsync, before its callers are answered."""

    def sizes() -> dict[Path, int]:
        found = {}
        for path in store.glob("journal/*/*/segment-*.rpj"):
            with contextlib.suppress(OSError):
                found[path] = path.stat().st_size
        return found

    before = sizes()
    deadline = time.monotonic() + COMMIT_WAIT_S
    while live.process.returncode is None and time.monotonic() < deadline:
        await asyncio.sleep(_COMMIT_POLL_S)
        now = sizes()
        if any(size > before.get(path, 0) for path, size in now.items()):
            return True
        before = now
    return False


class Published:
    """The snapshots with saved episodes (or, in journal mode, journaled tries) a run
    publishes in a trial's store, seen from outside its process
    (``PlannedFault.after_snapshots``)."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self._manifests = store / "snapshots"
        self._before = {p.parent.name for p in self._manifests.glob("*/manifest.json")}
        self._seen: set[str] = set()
        self._any: set[str] = set()

    def _look(self) -> None:
        for path in self._manifests.glob("*/manifest.json"):
            name = path.parent.name
            if name in self._before or name in self._seen:
                continue
            self._any.add(name)
            try:
                doc = orjson.loads(path.read_bytes())
                # A journal-mode snapshot saves no episode: it lists its tries in flight
                # as journaled (snapshot.mode: journal), the state a fault acts on then.
                if doc["episodes"] or doc.get("journaled"):
                    self._seen.add(name)
            except (OSError, ValueError, KeyError):
                continue  # pruned meanwhile, or not ours to judge: looked at again

    async def wait_for(self, count: int, *, with_episodes: bool = True) -> None:
        """Until this run has published ``count`` snapshots with saved episodes (or of
        any kind; retention may have pruned some since: each is counted once seen)."""
        seen = self._seen if with_episodes else self._any
        while len(seen) < count:
            self._look()
            if len(seen) < count:
                await asyncio.sleep(_PUBLISHED_POLL_S)
