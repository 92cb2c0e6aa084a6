"""Episodes whose state lives outside rollpoint (``checkpoint_mode: external``): what a
checkpoint saves of them, and whether a restored one continues.

Owns the saved form of an external episode (``{"version", "snapshot"}`` in place of an
export: the state's own version, and a handle from ``Environment.snapshot`` or None) and
the decision at install, for each saved episode::

    the version to continue at = the version journaled with the episode's last tool call
                                 after the snapshot (journal on), else the saved version
    attach(task, rollout) → state at that version? ─ yes ─▶ continue on it; the journaled
            │ no                                          calls after the snapshot are
            │                                             answered, not run (the state
            │                                             already holds them)
    a snapshot handle saved? ─ yes ─▶ restore_snapshot(task, rollout, handle); the journaled
            │ no                       calls after it are replayed on it (tool_journal)
    lost: not installed, so the trainer restarts it from its task and reports it restarted

An attached episode must be asked its journaled calls again, in order and the same (the
agent re-walks its turns from the snapshot, the model server answering them from its
journal): a call that is not the next journaled one means the conversation went another
way than the state did, and the episode fails with one line rather than continue on
mismatched state.

Does not own: the journal (:mod:`~rollpoint.servers.resources.tool_journal`), the
episodes (the service).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import JsonValue

from rollpoint.envs.base import Environment, check_declarations
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import EpisodeError
from rollpoint.protocol.participant import CheckpointMode
from rollpoint.servers.resources.environment_calls import environment_call

log = logging.getLogger(__name__)

CallKey = tuple[int, int]
"""(turn, call index)"""


def is_external(environment: Environment[Any]) -> bool:
    return environment.checkpoint_mode is CheckpointMode.EXTERNAL


def check_external(environment: Environment[Any]) -> None:
    """An ``external`` environment must say what version its state is at (and its effect
    names must be keys): checked again for an environment given as an instance."""
    check_declarations(environment)


def version_of(environment: Environment[Any], state: Any, rollout_id: str) -> str:
    with environment_call(environment, "version", rollout_id):
        return environment.version(state)


def saved_form(environment: Environment[Any], state: Any, rollout_id: str) -> dict[str, JsonValue]:
    """What a checkpoint keeps of an external episode instead of its export."""
    version = version_of(environment, state, rollout_id)
    with environment_call(environment, "snapshot", rollout_id):
        handle = environment.snapshot(state)
    return {"version": version, "snapshot": handle}


@dataclass
class Journaled:
    """One tool call journaled after the snapshot: what it asked and what it answered."""

    key: CallKey
    fingerprint: str
    result: dict[str, Any]
    version: str | None


@dataclass
class Reattached:
    state: Any
    pending: deque[Journaled]
    """Journaled calls the state already holds, to be asked again in order: empty when the
    state was made from a snapshot (then they are replayed on it instead)."""


def reattach(
    environment: Environment[Any],
    task: TaskRow,
    rollout_id: str,
    saved: Mapping[str, Any],
    journaled: list[Journaled],
) -> Reattached | None:
    """The state a restored external episode continues on, or None: lost (restart it)."""
    want = saved.get("version")
    if journaled and journaled[-1].version is not None:
        want = journaled[-1].version
    with environment_call(environment, "attach", rollout_id):
        state = environment.attach(task, rollout_id)
    if state is not None:
        found = version_of(environment, state, rollout_id)
        if found == want:
            return Reattached(state, deque(journaled))
        log.warning(
            "environment %s: the external state of rollout %s is at version %s, not %s",
            environment.name,
            rollout_id,
            found,
            want,
        )
        environment.close(state)
    handle = saved.get("snapshot")
    if handle is not None:
        with environment_call(environment, "restore_snapshot", rollout_id):
            return Reattached(environment.restore_snapshot(task, rollout_id, handle), deque())
    log.warning(
        "environment %s: rollout %s has no external state at version %s and no snapshot:"
        " it restarts from its task",
        environment.name,
        rollout_id,
        want,
    )
    return None


def next_journaled(
    environment: str, episode: str, pending: deque[Journaled], key: CallKey, fingerprint: str
) -> Journaled:
    """The journaled call an attached episode asks again now; EpisodeError when it asks
    another one (its conversation and its external state went different ways)."""
    expected = pending[0]
    if expected.key != key or expected.fingerprint != fingerprint:
        turn, call = expected.key
        raise EpisodeError(
            f"environment {environment!r}: episode {episode} continued on external state"
            f" that already holds its call at turn {turn} (call {call}), but asked turn"
            f" {key[0]} call {key[1]} {'another call' if expected.key == key else 'instead'};"
            " it cannot continue on that state"
        )
    return pending.popleft()
