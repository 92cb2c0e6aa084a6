"""Rows played to the end on an agent directly, past the dispatcher.

Tests use it to get an agent into a state the dispatcher alone would reach only by chance:
holding finished replies that the trainer has not received. It owns building the
``/run`` request and reading every result line (so each row finishes and its reply stays
on the agent); it does not seal, ack or record anything in a ledger.
"""

from __future__ import annotations

from rollpoint.http.client import HttpClient
from rollpoint.protocol.episode import RunRequest, RunRow, TaskRow
from rollpoint.protocol.ids import EpisodeId
from rollpoint.trainer.state.ledger import RecoveryLedger

MAX_TURNS = 12


async def play(agent_url: str, rows: list[tuple[EpisodeId, str, int]], *, task: TaskRow) -> None:
    """Run ``rows`` (episode, group id, row) of ``task`` to the end on the agent at
    ``agent_url``, reading every result; asserts each one finished."""
    request = RunRequest(
        rows=[
            RunRow(task=task, group_id=group_id, row=row, episode=episode, max_turns=MAX_TURNS)
            for episode, group_id, row in rows
        ]
    )
    async with HttpClient() as client:
        lines = [
            line
            async for line in client.stream_ndjson(
                f"{agent_url}/run", request.model_dump(mode="json")
            )
        ]
    assert [line["kind"] for line in lines] == ["finished"] * len(rows)


async def play_directly(
    ledger: RecoveryLedger, agent_url: str, rows: list[int], *, group_id: str = "g"
) -> None:
    """Play the current tries of ``group_id``'s ``rows``, as the ledger holds them."""
    records = [ledger.current(group_id, row) for row in rows]
    task = ledger.task(records[0].task_id)
    await play(agent_url, [(r.episode, r.group_id, r.row) for r in records], task=task)
