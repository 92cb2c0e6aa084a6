"""Performance tricks, each kept in one module and named by the bench item that pays for it.

- :mod:`~rollpoint.tuning.collector_pause`: the cyclic garbage collector paused while a
  large document is decoded or a checkpoint holds a process (``snapshot_io``, ``snapshot_pause``);
- :mod:`~rollpoint.tuning.collector_schedule`: full collections run right after a
  checkpoint's pause, not when CPython's thresholds say (``snapshot_pause_100k``);
- :mod:`~rollpoint.tuning.collector_listener`: both of those around each checkpoint, per
  fence and for the trainer's coordinator, heard on the seam (``snapshot_pause``,
  ``snapshot_pause_100k``);
- :mod:`~rollpoint.tuning.deferred_value`: a record value made when it is written, not
  inside the pause (``snapshot_pause``);
- :mod:`~rollpoint.tuning.encoded_json`: JSON encoded once and kept as a fragment a writer
  copies (``snapshot_io``);
- :mod:`~rollpoint.tuning.thread_switch`: the GIL handed to a waiting thread after 0.5 ms,
  not 5 ms, so a server's control thread does not wait behind a saturated data loop
  (``control_latency``); a server process's entry point calls it.

And the seam they hang on, :mod:`~rollpoint.tuning.seam`: a fence and the trainer's snapshot
coordinator emit checkpoint events (in use, hold, release, closed) and hold no trick; each
process's entry point calls :func:`install` once (a server process, ``run_job``, a
``LocalCluster``, the bench harnesses), and the listeners it installs act on them. A
participant (the SDK, a built-in server) takes the record-value tricks from the seam too,
never from their modules (a test reads the imports).

None of them changes what is computed or written: turn one off (or install nothing) and
every test still passes, only slower (the bench item says how much). :mod:`rollpoint.store`
knows files; these know the interpreter.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollpoint.tuning.collector_listener import CollectorListener

__all__ = ["install"]

_INSTALL_LOCK = threading.Lock()
_collector_listener: CollectorListener | None = None


def install() -> None:
    """Install this process's listeners on the seam: the collector's, on the process's
    schedule. Idempotent: a listener already installed is not installed again (an entry
    point may run inside another, e.g. a ``LocalCluster`` under ``run_job``)."""
    global _collector_listener
    # Here, not at the top: a module that imports the seam loads no trick by it.
    from rollpoint.tuning import seam
    from rollpoint.tuning.collector_listener import CollectorListener

    with _INSTALL_LOCK:
        if _collector_listener is None:
            _collector_listener = CollectorListener()
        seam.add_listener(_collector_listener)
