"""A journal kept in an object store: closed segments shipped to an fsspec URL on an interval.

Owns the copy of a local :class:`~rollpoint.store.journal.Journal` at an fsspec URL
(``s3://bucket/run/journal/model-0``...), bringing it back to a local folder, and the
journaling servers' one way to open their journal in a snapshot store of either kind
(:func:`open_store_journal`: in the folder itself for a local store; for an fsspec store,
in a local spool that a :class:`Shipping` ships).

An object store has no append and no fsync: a journal there is written locally (a spool
folder on the participant's disk, :func:`spool_folder`, with group commits as anywhere) and
every ``every_s`` the :class:`SegmentShipper` closes the active segment, if it holds records, and puts each
closed segment not yet shipped as one object (whole or not at all). So the recovery point
differs by what is lost:

- the process (SIGKILL, OOM) with its disk: nothing acknowledged is lost; the spool is read
  back on restart and the rest shipped then;
- the machine or its disk: what was appended since the last shipped segment, at most
  ``every_s`` plus one upload. That interval is the journal's recovery point in an object
  store; say so to whoever configures it.

:func:`fetch_segments` brings the shipped segments into an empty (or partial) spool before
:meth:`Journal.open` on a new machine. Retention (the trainer's snapshot store) deletes
shipped segments no kept snapshot needs at the URL; each ship then deletes their spool
copies too, and the journal forgets them at its next checkpoint
(:meth:`Journal.forget_removed`). It does not know the segment format beyond names.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass

from rollpoint.store.filesystem import Filesystem, filesystem_for, is_url
from rollpoint.store.journal import Journal
from rollpoint.store.journal_format import segment_number
from rollpoint.store.journal_retention import JOURNAL_DIR

__all__ = [
    "SPOOL_ENV",
    "SegmentShipper",
    "Shipping",
    "ShippingMetrics",
    "fetch_segments",
    "open_store_journal",
    "spool_folder",
]

log = logging.getLogger(__name__)

SPOOL_ENV = "ROLLPOINT_JOURNAL_SPOOL"
"""Where a journal of an fsspec snapshot store is spooled on this machine (default
``~/.cache/rollpoint/journal-spool``): one folder per journal URL under it."""
SHIP_EVERY_S = 1.0
"""How often a journaling server ships its closed segments to an fsspec store: the
journal's recovery point there when a machine is lost with its disk (docs/journal.md)."""


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
        yet shipped; returns their names, oldest first. Then delete the spool copies of the
        segments retention deleted at the URL."""
        await self.journal.rotate()
        names = await asyncio.to_thread(self._unshipped)
        for name in names:
            self._shipped[name] = await asyncio.to_thread(self._put, name)
        self.metrics.last_shipped_at = time.time()
        await asyncio.to_thread(self._drop_pruned)
        return names

    def _drop_pruned(self) -> None:
        present = set(self._remote.listdir(self.url))
        closed = set(self.journal.closed_segments())
        for name in [n for n in self._shipped if n not in present and n in closed]:
            # Shipped, then deleted there: retention's, since no kept snapshot needs it.
            with contextlib.suppress(FileNotFoundError):
                self._local.remove_file(self._local.join(self.journal.folder, name))
            del self._shipped[name]

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


def spool_folder(url: str) -> str:
    """The local folder a journal shipped to ``url`` is spooled in on this machine: the same
    one for the same URL, so a server restarted here reads what it had not shipped yet."""
    base = os.environ.get(SPOOL_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "rollpoint", "journal-spool"
    )
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return os.path.join(base, f"{digest}-{url.rstrip('/').rsplit('/', 1)[-1]}")


class Shipping:
    """A :class:`SegmentShipper` running on the event loop until :meth:`aclose`."""

    def __init__(self, journal: Journal, url: str, *, every_s: float = SHIP_EVERY_S) -> None:
        self.shipper = SegmentShipper(journal, url, every_s=every_s)
        self._stop = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.shipper.run(self._stop)
                return
            except Exception as exc:  # the store is down: try again next interval
                log.warning("journal %s: shipping failed: %s", self.shipper.url, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.shipper.every_s)
                if self._stop.is_set():
                    return

    async def aclose(self) -> None:
        """Ship what is left (the active segment closed first), then stop."""
        self._stop.set()
        await self._task


def journal_relative(kind: str, name: str, replica: str) -> str:
    """A participant's journal folder relative to the store root,
    ``journal/<kind>/<name>-<replica>``: as a snapshot's mark, retention and ``inspect``
    name it."""
    return f"{JOURNAL_DIR}/{kind}/{name}-{replica}"


def journal_url(root: str, relative: str) -> str:
    """The folder ``relative`` in the snapshot store ``root`` (a path or an fsspec URL)."""
    return f"{root.rstrip('/')}/{relative}"


async def open_store_journal(
    root: str, relative: str, *, window_s: float
) -> tuple[Journal, Shipping | None]:
    """The journal at ``relative`` in the snapshot store ``root``: in that folder for a
    local store; for an fsspec store, in this machine's spool (:func:`spool_folder`), with
    what was shipped there and is not in the spool fetched first, and a :class:`Shipping`
    started (close it before the journal)."""
    url = journal_url(root, relative)
    if not is_url(root):
        return await asyncio.to_thread(Journal.open, url, window_s=window_s), None
    spool = spool_folder(url)
    fetched = await asyncio.to_thread(fetch_segments, url, spool)
    if fetched:
        log.info("journal %s: %d segment(s) fetched into %s", url, len(fetched), spool)
    journal = await asyncio.to_thread(Journal.open, spool, window_s=window_s)
    return journal, Shipping(journal, url)
