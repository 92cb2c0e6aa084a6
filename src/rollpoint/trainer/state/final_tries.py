"""The recovery ledger's final tries: the part of it that grows with rows trained, kept on disk.

Owns every sealed or retired try of a run (one :data:`ArchivedEntry` tuple each), looked up
by rollout id, and their chunks as a snapshot saves them. A try becomes final once and never
changes again, and after that only a stray reply, a refused move or a saved document asks
for it — yet a run that trains millions of rows used to keep every one in memory: their
tuples, the dict over them and each full chunk's cached JSON, ~0.42 KiB a row in the
trainer, never released (issue 33, the soak's trace).

So only the open chunk (up to ``CHUNK`` tries, the newest) is held in memory. When it
fills, its tries go in one transaction to a private temporary SQLite database — each as a
row keyed by rollout id, for look-ups, and the chunk's JSON once, for snapshots — and leave
memory: what stays is a :class:`StoredChunk` of a few dozen bytes per ``CHUNK`` tries.

- **The database is a cache, not a saved state.** ``sqlite3.connect("")`` opens a database
  on disk that no other connection can open and that SQLite deletes when it is closed (on a
  kill, the operating system: SQLite unlinks the file as it opens it). Its page cache is
  bounded (:data:`CACHE_KIB`). The snapshots hold the final tries as before (one record
  per chunk, :mod:`.ledger_document`); a restore fills a new database from them.
- **A stored chunk is the same object in every snapshot**, and so is its record (its JSON
  read from the database when a writer needs its bytes: a rebase, a compaction, the first
  write after a restart), so the store still references where it first wrote a chunk
  (:mod:`rollpoint.store.record_packs`) without the trainer holding its bytes.
- **Nothing refers back.** A stored chunk's record holds a value that refers to the
  database, not to the chunk that keeps the record: chunk → record → chunk is a cycle, freed
  only by a full collection, which the trainer schedules rarely (made that way first, every
  capture's copy of the open chunk stayed: 13 KiB a row in the soak).
- **Threads**: the ledger's thread adds and looks up; a snapshot's writer thread reads
  stored chunks while the ledger goes on. One connection, used under one lock.
- **Cost**: a restore inserts every final try again (about 4 CPU-s more per million rows, the
  B-tree inserts of random rollout ids), and a look-up of a stored try is a query (~10 µs);
  neither is inside a snapshot's pause.

It does not know what a final try means (:mod:`.ledger` does).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from typing import Any

import orjson

from rollpoint.store.record_packs import ValueMadeOnWrite
from rollpoint.trainer.state.append_log import CHUNK, LogChunk
from rollpoint.trainer.state.ledger_document import ArchivedEntry

CACHE_KIB = 2048
"""The database's page cache: what of the stored tries stays in memory at most."""

_SCHEMA = (
    # WITHOUT ROWID: the rollout id is the key the rows are stored by, not a second index.
    "CREATE TABLE finals (rollout_id TEXT PRIMARY KEY, state TEXT NOT NULL,"
    " group_id TEXT NOT NULL, row INTEGER NOT NULL, attempt INTEGER NOT NULL,"
    " replica TEXT, tries INTEGER NOT NULL) WITHOUT ROWID",
    "CREATE TABLE chunks (number INTEGER PRIMARY KEY, json BLOB NOT NULL)",
)


class _Database:
    """The private temporary database and its lock. Stored chunks hold this, not the
    :class:`FinalTries`, so nothing refers back: dropping the ledger and its captures
    closes the connection (and SQLite deletes the file)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # check_same_thread=False: a snapshot's writer thread reads chunks (under the lock).
        self._db = sqlite3.connect("", check_same_thread=False, isolation_level=None)
        self._db.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
        # A cache rebuilt from the snapshots: no rollback journal, no fsync.
        self._db.execute("PRAGMA journal_mode = OFF")
        self._db.execute("PRAGMA synchronous = OFF")
        for statement in _SCHEMA:
            self._db.execute(statement)

    def store(self, number: int, items: tuple[ArchivedEntry, ...]) -> None:
        encoded = orjson.dumps(items)
        rows = ((e[3], e[0], e[1], e[2], e[4], e[5], e[6]) for e in items)
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute("INSERT INTO chunks VALUES (?, ?)", (number, encoded))
                self._db.executemany("INSERT INTO finals VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def get(self, rollout_id: str) -> ArchivedEntry | None:
        with self._lock:
            row = self._db.execute(
                "SELECT state, group_id, row, rollout_id, attempt, replica, tries"
                " FROM finals WHERE rollout_id = ?",
                (rollout_id,),
            ).fetchone()
        return None if row is None else row

    def contains(self, rollout_id: str) -> bool:
        with self._lock:
            found = self._db.execute(
                "SELECT 1 FROM finals WHERE rollout_id = ?", (rollout_id,)
            ).fetchone()
        return found is not None

    def json(self, number: int) -> bytes:
        with self._lock:
            (encoded,) = self._db.execute(
                "SELECT json FROM chunks WHERE number = ?", (number,)
            ).fetchone()
        return bytes(encoded)


class StoredChunk:
    """A full chunk of final tries whose items are in the database, not in memory.

    Behaves as a :class:`~.append_log.LogChunk` of them (its ``items`` are read back when
    asked for), remembers its snapshot record like one, and hands out its JSON as stored.
    """

    __slots__ = ("_db", "_length", "_number", "_record")

    def __init__(self, db: _Database, number: int, length: int) -> None:
        self._db = db
        self._number = number
        self._length = length
        self._record: dict[str, Any] | None = None

    def __len__(self) -> int:
        return self._length

    @property
    def items(self) -> tuple[ArchivedEntry, ...]:
        return tuple(tuple(entry) for entry in orjson.loads(self._db.json(self._number)))

    def encoded(self, encode: Callable[[tuple[ArchivedEntry, ...]], bytes]) -> bytes:
        """The chunk's JSON: the stored bytes when ``encode`` is ``orjson.dumps``, what they
        were made with; anything else encodes the items read back."""
        if encode is orjson.dumps:
            return self._db.json(self._number)
        return encode(self.items)

    def record(self, make: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """``make(self)``, made the first time only and the same object afterwards."""
        if self._record is None:
            self._record = make(self)
        return self._record

    def json_value(self) -> _StoredJson:
        """A record value the writer writes as this chunk's JSON, read from the database
        then; it refers to the database, not to this chunk (whose record holds it)."""
        return _StoredJson(self._db, self._number)


class _StoredJson(ValueMadeOnWrite):
    __slots__ = ("_db", "_number")

    def __init__(self, db: _Database, number: int) -> None:
        self._db = db
        self._number = number

    def value(self) -> object:
        return orjson.Fragment(self._db.json(self._number))


class FinalTries:
    """The final tries, by rollout id: the open chunk in memory, full ones in the database."""

    def __init__(self, chunk: int = CHUNK) -> None:
        if chunk < 1:
            raise ValueError(f"chunk size must be >= 1, got {chunk}")
        self._chunk = chunk
        self._open: dict[str, ArchivedEntry] = {}
        self._tail: LogChunk[ArchivedEntry] | None = None
        """The open chunk's last capture, while nothing was added since."""
        self._stored: list[StoredChunk] = []
        self._db: _Database | None = None
        """Opened when the first chunk fills: a short run never makes a database."""
        self._count = 0

    def add(self, entry: ArchivedEntry) -> None:
        """Keep a final try; its rollout id must be new (the ledger checked it)."""
        self._tail = None
        self._open[entry[3]] = entry
        self._count += 1
        if len(self._open) == self._chunk:
            if self._db is None:
                self._db = _Database()
            items = tuple(self._open.values())
            self._db.store(len(self._stored), items)
            self._stored.append(StoredChunk(self._db, len(self._stored), len(items)))
            self._open = {}

    def get(self, rollout_id: str) -> ArchivedEntry | None:
        entry = self._open.get(rollout_id)
        if entry is None and self._db is not None:
            return self._db.get(rollout_id)
        return entry

    def __contains__(self, rollout_id: object) -> bool:
        if rollout_id in self._open:
            return True
        return (
            self._db is not None and isinstance(rollout_id, str) and self._db.contains(rollout_id)
        )

    def __len__(self) -> int:
        return self._count

    @property
    def stored_chunks(self) -> int:
        return len(self._stored)

    @property
    def held(self) -> int:
        """Final tries held in memory: the open chunk's, fewer than its size."""
        return len(self._open)

    def capture(self) -> tuple[StoredChunk | LogChunk[ArchivedEntry], ...]:
        """Every final try so far, as chunks: the stored ones shared, the open one copied
        (again only once something was added to it, as :meth:`AppendLog.capture
        <.append_log.AppendLog.capture>`)."""
        if self._tail is None:
            self._tail = LogChunk(tuple(self._open.values()))
        return (*self._stored, self._tail)
