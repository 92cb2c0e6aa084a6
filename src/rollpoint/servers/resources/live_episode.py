"""One episode of a resources server as its service holds it, and the forms a checkpoint
takes of it.

Owns :class:`LiveEpisode`: a rollout's environment state, its task and its idempotency
table (``(turn, call_index) → ToolResult`` with the fingerprint of the call that made it),
what a call that leaves the event loop holds on it while it runs, and the two saved forms
taken of it: the state image's entry (:meth:`LiveEpisode.image_entry`: the export taken on
the event loop, packed later by a snapshot's writer, or an external episode's version) and
the :class:`~rollpoint.servers.resources.episode_record.EpisodeRecord` of a plain export
(:meth:`LiveEpisode.record`).

Does not own: the episodes by rollout id, the gate and the tool calls (the service,
:mod:`~rollpoint.servers.resources.episode_service`), the record's format and the packing
(:mod:`~rollpoint.servers.resources.episode_record`), rebuilding an episode from its record
(:mod:`~rollpoint.servers.resources.episode_install`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rollpoint.envs.base import Environment
from rollpoint.protocol.episode import TaskRow, ToolResult
from rollpoint.protocol.errors import EpisodeError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.resources.environment_calls import environment_call
from rollpoint.servers.resources.episode_record import EpisodeRecord, ToolResultRecord, pack_state
from rollpoint.servers.resources.external_state import Journaled, is_external, saved_form
from rollpoint.tuning.seam import DeferredValue


@dataclass
class LiveEpisode:
    task: TaskRow
    state: Any
    results: dict[tuple[int, int], ToolResult] = field(default_factory=dict)
    fingerprints: dict[tuple[int, int], str] = field(default_factory=dict)
    """The :func:`call_fingerprint` of each key's first call; a key restored from a record
    saved without one has none, and replays for any call."""
    task_json: dict[str, Any] | None = None
    """``task`` dumped once: at start, or by the first checkpoint (installed episodes)."""
    packed_state: str | DeferredValue[str] | None = None
    """``state`` as the state image last took it: the export is taken on the event loop
    and packed by a snapshot's writer (a :class:`DeferredValue`, swapped for its string by
    the next remake once made). Cleared before any tool call runs, so only the episodes
    that changed are exported and packed again."""

    touched: bool = False
    """A tool call ran on it, or it was installed from a saved state: ``state`` may differ
    from ``start(task)``."""

    busy: asyncio.Event | None = None
    """Set while a call that gives up the event loop (async, or in a worker thread) runs
    on the episode; set (the event) when it ends. Another call of the episode waits for
    it; a call that stays on the loop cannot be interleaved, so no lock is kept for it."""
    saved_while_busy: dict[str, Any] | None = None
    """While a call that left the event loop runs: the state image's entry from before
    it, what the image holds until the call's result is stored."""
    dropped: bool = False
    """Released or replaced while a call ran on it: that call closes the state when done."""
    versions: dict[tuple[int, int], str] = field(default_factory=dict)
    """External episodes: the state's version right after the last call applied here (what
    the tool journal records with the call; one entry, so it stays bounded)."""
    attached: deque[Journaled] | None = None
    """An external episode continued on its live state after a restore: the journaled calls
    that state already holds, answered (not run) as the agent asks them again
    (:mod:`~rollpoint.servers.resources.external_state`)."""

    def changing(self) -> None:
        """Forget the last export: ``state`` or ``results`` is about to change."""
        self.packed_state = None
        self.touched = True

    def image_entry(self, environment: Environment[Any], rollout_id: str) -> dict[str, Any]:
        """The state image's entry of the rollout: its :class:`EpisodeRecord` as JSON data
        without ``kind`` and ``episode`` (the attempt it is saved for is the scope's). Its
        ``packed_state`` may be deferred; the entry is read in the writer's thread and
        never changed (a change makes a new one)."""
        if self.saved_while_busy is not None:
            return self.saved_while_busy
        if self.task_json is None:
            self.task_json = self.task.model_dump(mode="json")
        fresh = not self.touched and environment.reproducible_start
        packed = self.packed_state
        if fresh:
            pass  # saved as its task: nothing of the state to copy
        elif packed is None and is_external(environment):
            # Nothing of the state is exported: its version (and a snapshot handle).
            self.packed_state = pack_state(saved_form(environment, self.state, rollout_id))
        elif packed is None:
            # The export is a copy taken now: later tool calls change the state, never the
            # copy, so packing it can wait for a writer's thread. The environment may leave
            # its own encoding for later too (capture_state).
            with environment_call(environment, "capture_state", rollout_id):
                make_export = environment.capture_state(self.state)
            self.packed_state = DeferredValue(
                partial(_pack_later, make_export, environment.name),
                f"packed state of rollout {rollout_id}",
            )
        elif isinstance(packed, DeferredValue) and packed.made:
            self.packed_state = packed.value()  # an entry made from now on holds the string
        return {
            "rollout_id": rollout_id,
            "environment": self.task.environment,
            "task": self.task_json,
            "state": None,
            "packed_state": None if fresh else self.packed_state,
            "fresh_start": fresh,
            "tool_results": [
                {
                    "turn": turn,
                    "call_index": index,
                    "result": {
                        "content": result.content,
                        "is_error": result.is_error,
                        "replayed": result.replayed,
                    },
                    "fingerprint": self.fingerprints.get((turn, index)),
                }
                for (turn, index), result in self.results.items()
            ],
        }

    def record(
        self, environment: Environment[Any], rollout_id: str, saved_for: EpisodeId | None = None
    ) -> EpisodeRecord:
        """The episode as a plain export saves it, from its live state."""
        if is_external(environment):
            state = saved_form(environment, self.state, rollout_id)
        else:
            with environment_call(environment, "export_state", rollout_id):
                state = environment.export_state(self.state)
        return EpisodeRecord(
            episode=saved_for,
            rollout_id=rollout_id,
            environment=self.task.environment,
            task=self.task,
            state=state,
            tool_results=[
                ToolResultRecord(
                    turn=turn,
                    call_index=index,
                    result=result,
                    fingerprint=self.fingerprints.get((turn, index)),
                )
                for (turn, index), result in self.results.items()
            ],
        )


def _pack_later(make_export: Callable[[], Mapping[str, Any]], environment: str) -> str:
    exported = make_export()
    try:
        return pack_state(exported)
    except TypeError as exc:  # orjson's encode error is one: a set, bytes, a non-str key
        # The author's mistake, told in their terms: the snapshot fails (DeferredValue
        # names the rollout) and the run goes on.
        raise EpisodeError(
            f"environment {environment!r}: export_state returned data that is not JSON-safe ({exc})"
        ) from None
