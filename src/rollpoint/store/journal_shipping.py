"""A journal kept in an object store: closed segments shipped to an fsspec URL on an interval.

Owns the copy of a local :class:`~rollpoint.store.journal.Journal` at an fsspec URL
(``s3://bucket/run/journal/model-0``...) and bringing it back to a local folder.

An object store has no append and no fsync: a journal there is written locally (a spool
folder on the participant's disk, with group commits as anywhere) and every ``every_s``
the :class:`SegmentShipper` closes the active segment, if it holds records, and puts each
closed segment not yet shipped as one object (whole or not at all). So the recovery point
differs by what is lost:

- the process (SIGKILL, OOM) with its disk: nothing acknowledged is lost; the spool is read
  back on restart and the rest shipped then;
- the machine or its disk: what was appended since the last shipped segment, at most
  ``every_s`` plus one upload. That interval is the journal's recovery point in an object
  store; say so to whoever configures it.

:func:`fetch_segments` brings the shipped segments into an empty (or partial) spool before
:meth:`Journal.open` on a new machine. It does not know the segment format beyond names.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from rollpoint.store.filesystem import Filesystem, filesystem_for, is_url
from rollpoint.store.journal import Journal
from rollpoint.store.journal_format import segment_number

__all__ = ["SegmentShipper", "ShippingMetrics", "fetch_segments"]


@dataclass(slots=True)
class ShippingMetrics:
    segments: int = 0
    bytes: int = 0
    last_shipped_at: float | None = None
    """``time.time()`` of the last completed ship (None before the first)."""


class SegmentShipper:
    """Puts ``journal``'s closed segments at ``url`` every ``every_s`` seconds."""

    def __init__(self, journal: Journal, url: str, *, every_s: float = 1.0) -> None:
        if not is_url(url):
            raise ValueError(f"journal shipping target {url!r} is not an fsspec URL")
        self.journal = journal
        self.url = url.rstrip("/")
        self.every_s = every_s
        self.metrics = ShippingMetrics()
        self._remote: Filesystem = filesystem_for(self.url)
        self._local: Filesystem = filesystem_for(journal.folder)
        # Name → size of what is at the URL. A closed segment is shipped when its name is not
        # there, or is there with another size: after a cut the journal sets aside the
        # segments that followed and writes new ones under the same numbers.
        self._shipped = {
            name: self._remote.size(self._remote.join(self.url, name))
            for name in self._remote.listdir(self.url)
            if segment_number(name) is not None
        }

    async def ship_once(self) -> list[str]:
        """Close the active segment if it holds records, then put every closed segment not
        yet shipped; returns their names, oldest first."""
        await self.journal.rotate()
        names = await asyncio.to_thread(self._unshipped)
        for name in names:
            self._shipped[name] = await asyncio.to_thread(self._put, name)
        self.metrics.last_shipped_at = time.time()
        return names

    def _unshipped(self) -> list[str]:
        folder = self.journal.folder
        return [
            name
            for name in self.journal.closed_segments()
            if self._shipped.get(name) != self._local.size(self._local.join(folder, name))
        ]

    def _put(self, name: str) -> int:
        data = self._local.read_bytes(self._local.join(self.journal.folder, name))
        self._remote.write_bytes(self._remote.join(self.url, name), data)
        self.metrics.segments += 1
        self.metrics.bytes += len(data)
        return len(data)

    async def run(self, stop: asyncio.Event) -> None:
        """Ship every ``every_s`` until ``stop`` is set, then once more."""
        while not stop.is_set():
            await self.ship_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every_s)
        await self.ship_once()

    def forget(self, names: list[str]) -> None:
        """Delete the shipped copies of segments the journal dropped (its retention)."""
        for name in names:
            self._remote.remove_file(self._remote.join(self.url, name))
            self._shipped.pop(name, None)


def fetch_segments(url: str, folder: str) -> list[str]:
    """Copy the segments at ``url`` that ``folder`` lacks into it; returns their names.
    A segment already in ``folder`` is kept as it is: the local copy is at least as long."""
    remote = filesystem_for(url)
    local = filesystem_for(folder)
    local.makedirs(folder)
    have = set(local.listdir(folder))
    fetched = []
    for name in remote.listdir(url):
        if segment_number(name) is None or name in have:
            continue
        local.write_bytes(local.join(folder, name), remote.read_bytes(remote.join(url, name)))
        fetched.append(name)
    if fetched:
        local.sync_dir(folder)
    return fetched
