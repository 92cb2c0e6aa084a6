"""Run streams: one ``POST /run`` the dispatcher has open, and the lines it reads back.

Owns what one stream is (the group it serves, the replica it went to, its task, the tries
it still owes a result for), the request it sends, and turning each line of the reply into
a :data:`~rollpoint.protocol.episode.RowResult`. It does not open the connection, admit
rows, or decide what becomes of a result or of a row the stream never answers: the
:class:`~rollpoint.trainer.dispatch.dispatcher.Dispatcher` does.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import TypeAdapter, ValidationError

from rollpoint.protocol.episode import RowResult, RunRequest, RunRow
from rollpoint.protocol.errors import TransportError
from rollpoint.trainer.dispatch.group_run import GroupRun
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_record import LedgerRecord

_ROW_RESULT: TypeAdapter[RowResult] = TypeAdapter(RowResult)


class RunStream:
    """One ``POST /run``: the replica it went to and the rows it still owes."""

    def __init__(self, group: GroupRun, replica: str, task: asyncio.Task[Any] | None) -> None:
        self.group = group
        self.replica = replica
        self.task = task
        self.pending: dict[str, LedgerRecord] = {}

    def request(self, ledger: RecoveryLedger, max_turns: int) -> RunRequest:
        """The ``/run`` body for the rows this stream owes."""
        return RunRequest(
            rows=[
                RunRow(
                    task=ledger.task(r.task_id),
                    group_id=r.group_id,
                    row=r.row,
                    episode=r.episode,
                    max_turns=max_turns,
                )
                for r in self.pending.values()
            ]
        )


def parse_row_result(line: Any, url: str) -> RowResult:
    try:
        return _ROW_RESULT.validate_python(line)
    except ValidationError as exc:
        raise TransportError(f"POST {url}: a stream line is not a row result: {exc}") from None
