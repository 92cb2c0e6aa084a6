"""What ``rollpoint run`` checks before any server starts: that it can write where it must.

Owns the probes of the workdir and of the snapshot store (a local path or an fsspec URL):
each is created if missing, then a probe file is written and removed. A failure is one
:class:`ConfigError` line naming the path and the reason, before anything started, rather
than a traceback from the first write or, worse, snapshots that fail one by one in the log
while the run goes on. It also words what a run cannot read as it resumes (the store's folders,
``train_data.jsonl``) as one line (:func:`unreadable`). It does not check a store that stops
being writable mid-run (the coordinator counts failed snapshots).
"""

from __future__ import annotations

import os
from pathlib import Path

from rollpoint.protocol.errors import ConfigError
from rollpoint.store.filesystem import filesystem_for, normalize_location

_PROBE = ".rollpoint-write-probe"


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def check_workdir_writable(workdir: Path) -> None:
    """Create ``workdir`` if missing and write a file in it; one line naming it if not."""
    probe = workdir / f"{_PROBE}-{os.getpid()}"
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"workdir {workdir} is not writable: {_reason(exc)}") from None


def check_store_writable(root: str) -> None:
    """The same for ``snapshot.store`` (or the workdir's snapshots folder)."""
    location = normalize_location(root)
    fs = filesystem_for(location)
    probe = fs.join(location, f"{_PROBE}-{os.getpid()}")
    try:
        fs.makedirs(location)
        fs.write_bytes(probe, b"")
        fs.remove_file(probe)
    except OSError as exc:
        raise ConfigError(f"snapshot.store {root} is not writable: {_reason(exc)}") from None


def unreadable(exc: OSError, what: str) -> ConfigError:
    """One line for an :class:`OSError` met while reading ``what`` (the file it names, if any)."""
    where = exc.filename if exc.filename is not None else what
    return ConfigError(f"cannot read {where} ({what}): {_reason(exc)}")
