"""Restoring an episode by replaying what it did, every answer checked against the record.

Owns what the adapters whose saved state is "a fresh start plus every step taken, with the
answer it got" share (``gymnasium:``, ``openenv:``, ``nemo-gym:``): reading the saved form
back (a one-line refusal naming the task and the field at fault), the seed check, walking
the saved steps on a fresh start while comparing each answer with the recorded one
(:class:`Replay`), the one line that says where a replay went another way, and the notice
an episode that restarted instead gives with its next tool result. Each adapter owns its
start, how it takes a step and reads the answer, and what a divergence costs it (closing
the fresh start and opening another).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import InvalidCheckpointStateError

M = TypeVar("M", bound=BaseModel)
A = TypeVar("A")
"""A saved step (an action, a call)."""
_SHOWN = 300
"""Characters of an answer quoted in a divergence line."""


def read_saved(model: type[M], exported: Mapping[str, Any], environment: str, task: TaskRow) -> M:
    """``exported`` as the adapter's saved form ``model``; an InvalidCheckpointStateError
    naming the task and the first field at fault when it is not one."""
    try:
        return model.model_validate(exported)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise InvalidCheckpointStateError(
            f"{environment} state of task {task.task_id}: '{loc}': {err['msg']}"
        ) from None


def check_seeded(
    environment: str, task: TaskRow, seed: int, saved_seed: int, actions: int, steps: int
) -> None:
    """A saved episode of a seeded environment fits its task: the task's seed, one recorded
    answer per action."""
    if saved_seed != seed or steps != actions:
        raise InvalidCheckpointStateError(
            f"{environment} state of task {task.task_id}: seed {saved_seed} with {actions}"
            f" actions and {steps} steps does not fit the task (seed {seed})"
        )


def restart_notice(origin: str, step: str) -> str:
    """What the first tool result after a restart says (the episode starts again from
    ``origin``; ``step`` is what a tool call is to the environment)."""
    return (
        f"the environment could not be restored and restarted from {origin}; this {step}"
        " is the first of the new start"
    )


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}..."


class Replay(Generic[A]):
    """One replay of saved steps on a fresh start, checked answer by answer.

    Iterate it for the steps to take; after taking each, say what it answered
    (:meth:`answered`) or that it got no answer (:meth:`failed`). The iteration stops at
    the first divergence (:attr:`diverged` then holds the line saying where). The loop is
    the adapter's, so one written with ``await`` replays over a session as well.
    """

    def __init__(
        self,
        where: str,
        steps: Sequence[A],
        recorded: Sequence[object],
        *,
        shows: str | Callable[[A], str],
        step: str = "action",
        restarts: str = "from its seed",
    ) -> None:
        """``where``: the episode, as the line names it. ``shows``: what an answer is
        (``[observation, reward, done]``), or a function of the step saying so. ``step``
        and ``restarts`` word the line (``at action 3 of 5``, ``restarts from its seed``)."""
        if len(steps) != len(recorded):
            raise ValueError(f"{where}: {len(steps)} steps with {len(recorded)} answers")
        self.where = where
        self.steps = steps
        self.recorded = recorded
        self.shows = shows
        self.step = step
        self.restarts = restarts
        self.replayed = 0
        """Steps taken so far (the one that diverged included)."""
        self.diverged: str | None = None
        """None while every answer matched; else the one line saying where it did not."""
        self._at = -1

    def check_start(self, got: object, recorded: object, shows: str) -> bool:
        """The fresh start answered as the saved one did (else the replay diverged there:
        nothing to replay)."""
        if got != recorded:
            self.diverged = (
                f"{self.where}: replay diverged at reset ({shows} {_shown(got)}, recorded"
                f" {_shown(recorded)}); the episode restarts {self.restarts}"
            )
        return self.diverged is None

    def __iter__(self) -> Iterator[A]:
        for at, step in enumerate(self.steps):
            if self.diverged is not None:
                return
            self._at = at
            yield step

    def answered(self, got: object) -> None:
        """The step just taken answered ``got``: it diverged unless that is the record."""
        self.replayed = self._at + 1
        recorded = self.recorded[self._at]
        if got != recorded:
            step = self.steps[self._at]
            shows = self.shows if isinstance(self.shows, str) else self.shows(step)
            self.diverged = (
                f"{self.where}: replay diverged at {self.step} {self._at + 1} of"
                f" {len(self.steps)} ({shows} {_shown(got)}, recorded {_shown(recorded)});"
                f" the episode restarts {self.restarts}"
            )

    def failed(self, reason: object) -> None:
        """The step just taken got no answer (it may or may not have happened): the
        replay stops before it."""
        self.replayed = self._at
        self.diverged = (
            f"{self.where}: replay failed at {self.step} {self._at + 1} ({reason}); the"
            f" episode restarts {self.restarts}"
        )
