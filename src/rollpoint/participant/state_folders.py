"""Where one participant's state sits under the snapshot root, and a restore's read of it.

Owns :class:`StateFolders`: the folder of a participant's state in a checkpoint,
``<root>/<checkpoint_dir>/<kind>/<name>-<replica>`` (its own replica's by default, one per
source replica for a restore), resolved inside the snapshot root so a request's
``checkpoint_dir`` that leaves it is a 400; and a restore's read of those folders, each
decoded in a worker thread with the cyclic collector paused, their records merged. It does
not decide whether a commit or restore may run (the fence: :mod:`rollpoint.participant.fence`),
nor write anything (:mod:`rollpoint.participant.checkpoint_write`), nor the file format
(:mod:`rollpoint.store.participant_state`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import JsonValue

from rollpoint.participant.participant import Participant, await_hook
from rollpoint.protocol.errors import RestoreError
from rollpoint.protocol.manifest import ParticipantManifest
from rollpoint.store.filesystem import resolve_inside
from rollpoint.store.participant_state import read_participant_state
from rollpoint.tuning.collector_pause import collector_paused

__all__ = ["StateFolders"]


class StateFolders:
    """The state folders of one participant (``instance``: ``<name>-<replica>``)."""

    def __init__(self, participant: Participant, instance: str, *, root: str) -> None:
        self._participant = participant
        self._instance = instance
        self._root = root

    def folder(self, checkpoint_dir: str, replica: str | None = None) -> str:
        """``<root>/<checkpoint_dir>/<kind>/<name>-<replica>`` (its own replica by default);
        400 if it leaves the root."""
        folder = resolve_inside(self._root, checkpoint_dir)
        instance = self._instance if replica is None else f"{self._participant.name}-{replica}"
        return resolve_inside(folder, f"{self._participant.kind.value}/{instance}")

    def sources(self, checkpoint_dir: str, replicas: list[str] | None) -> dict[str, str]:
        """A restore's folders by instance: one per source replica named (its own if none),
        since an elastic restore merges several replicas' records."""
        return {
            f"{self._participant.name}-{r}": self.folder(checkpoint_dir, r)
            for r in dict.fromkeys(replicas or [self._participant.replica])
        }

    async def read(self, folders: dict[str, str], source: str) -> list[dict[str, JsonValue]]:
        """The records saved by checkpoint ``source`` in ``folders`` (instance → its state
        folder). Records merge by episode key, which is unique across replicas, so the
        order of the folders does not matter."""
        records: list[dict[str, JsonValue]] = []
        for instance, directory in folders.items():
            read = asyncio.to_thread(
                _read_state,
                directory,
                kind=self._participant.kind.value,
                instance=instance,
                checkpoint_id=source,
                root=self._root,
            )
            _, found = await await_hook("state read", read, RestoreError)
            records.extend(found)
        return records


def _read_state(
    directory: str, *, kind: str, instance: str, checkpoint_id: str, root: str
) -> tuple[ParticipantManifest, list[dict[str, Any]]]:
    """:func:`read_participant_state`, its decoding with the cyclic collector paused: the
    records hold no cycles, but their millions of containers would trigger collections over
    the growing heap (three quarters of a restore's time, ``snapshot_io``)."""
    with collector_paused():
        return read_participant_state(
            directory, kind=kind, instance=instance, checkpoint_id=checkpoint_id, root=root
        )
