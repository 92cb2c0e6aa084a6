"""``rollpoint run`` whose restore stops half-way, for a test that kills a run mid-restore.

Owns the launcher ``python -m tests.support.held_restore MARKER run CONFIG``: the trainer's
:class:`~rollpoint.trainer.restore.restorer.Restorer` installs the snapshot's state in
every participant as usual, then touches ``MARKER`` and waits forever before it resumes
the ledger or says "resumed from". A test that sees ``MARKER`` kills the run knowing the
kill lands inside the restore (polling for a printed line raced a restore of a few
milliseconds on a loaded machine). The participants run unchanged: only the trainer
process is started through this module.

It does not judge the run (the test does).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> None:
    marker = Path(argv[0])
    from rollpoint.trainer.restore.restorer import Restorer

    install = Restorer._install

    async def held(self: Restorer, *args: Any, **kwargs: Any) -> Any:
        await install(self, *args, **kwargs)
        await asyncio.to_thread(marker.touch)
        await asyncio.Event().wait()  # until the test kills the run

    Restorer._install = held  # type: ignore[method-assign]
    from rollpoint.app.cli import main as cli

    sys.argv = ["rollpoint", *argv[1:]]
    cli()


if __name__ == "__main__":
    main(sys.argv[1:])
