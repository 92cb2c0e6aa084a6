"""``rollpoint run`` that stops at a named point, for a test that kills a run exactly there.

Owns the launcher ``python -m tests.support.held_run POINT MARKER run CONFIG``: the trainer
process runs the CLI as usual until it reaches ``POINT``, touches ``MARKER`` and waits
forever (until the test kills the run). A test that polled for a printed line or a
folder raced steps of a few milliseconds on a loaded machine; a test that waits for
``MARKER`` knows where its kill lands. Points:

- ``restore``: every participant has installed the snapshot
  (:class:`~rollpoint.trainer.restore.installer.Installer`), the trainer has not resumed its
  ledger nor said "resumed from";
- ``publish``: a snapshot is written to its staging folder and about to be published
  (:meth:`~rollpoint.store.snapshot_store.SnapshotStore.publish`), held only once
  ``MARKER.arm`` exists, so the snapshots before it publish as usual;
- ``stop``: the run is on its way out and about to stop its servers
  (:meth:`~rollpoint.runtime.process_group.ProcessGroup.stop`, the first call), after
  everything before it (a final snapshot included). Held until the task is cancelled (a
  second signal), then the servers are stopped as they would have been.

The participants run unchanged: only the trainer process is started through this module.
It does not judge the run (the test does).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from typing import Any


def arm(marker: Path) -> Path:
    """The file whose existence lets a ``publish`` hold begin."""
    return marker.with_name(marker.name + ".arm")


def _hold_restore(marker: Path) -> None:
    from rollpoint.trainer.restore.installer import Installer

    install = Installer.install

    async def held(self: Installer, *args: Any, **kwargs: Any) -> Any:
        await install(self, *args, **kwargs)
        await asyncio.to_thread(marker.touch)
        await asyncio.Event().wait()

    Installer.install = held  # type: ignore[method-assign]


def _hold_publish(marker: Path) -> None:
    from rollpoint.store.snapshot_store import SnapshotStore

    publish = SnapshotStore.publish
    armed = arm(marker)

    def held(self: SnapshotStore, *args: Any, **kwargs: Any) -> Any:
        if armed.exists():
            marker.touch()
            threading.Event().wait()
        return publish(self, *args, **kwargs)

    SnapshotStore.publish = held  # type: ignore[method-assign]


def _hold_stop(marker: Path) -> None:
    from rollpoint.runtime.process_group import ProcessGroup

    stop = ProcessGroup.stop
    calls = 0

    async def held(self: ProcessGroup, *args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.to_thread(marker.touch)
            try:
                await asyncio.Event().wait()
            finally:
                await stop(self, *args, **kwargs)
        await stop(self, *args, **kwargs)

    ProcessGroup.stop = held  # type: ignore[method-assign]


HOLDS = {"restore": _hold_restore, "publish": _hold_publish, "stop": _hold_stop}


def main(argv: list[str]) -> None:
    point, marker = argv[0], Path(argv[1])
    HOLDS[point](marker)
    from rollpoint.app.cli import main as cli

    sys.argv = ["rollpoint", *argv[2:]]
    cli()


if __name__ == "__main__":
    main(sys.argv[1:])
