"""Participant records as a restore reads them back from disk.

Exports hand the writer records ready for orjson, with parts pre-encoded as
:class:`orjson.Fragment` (an agent session's row, messages and calls; a held reply): a test
that compares them with plain dumps, or installs them without the disk in between, decodes
them first, exactly as the write and the read would.
"""

from __future__ import annotations

from typing import Any

import orjson


def read_back(exported: Any) -> Any:
    """``exported`` (a record or a list of them) encoded and decoded again."""
    return orjson.loads(orjson.dumps(exported))
