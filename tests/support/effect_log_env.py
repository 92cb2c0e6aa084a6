"""A workplace environment whose effects also go to a log outside its state, as a real
payment, e-mail or ticket API's do: each calendar event or e-mail a tool call creates is
appended as one JSON line ``{"task", "effect"}`` to the file ``$ROLLPOINT_TEST_EFFECT_LOG``
names. Counting that file's lines is counting the effects the outside world saw.

A tool run again to rebuild an episode's state from the tool journal
(:func:`~rollpoint.servers.resources.tool_journal.replaying`) writes nothing there: the
effect happened when the call was first applied.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, ClassVar, cast

import orjson

from rollpoint.envs.base import Tool
from rollpoint.envs.workplace import WorkplaceEnvironment, WorkplaceState
from rollpoint.protocol.episode import TaskRow
from rollpoint.servers.resources.tool_journal import replaying

LOG_ENV = "ROLLPOINT_TEST_EFFECT_LOG"


class EffectLogEnvironment(WorkplaceEnvironment):
    """The workplace, with every new effect appended to ``$ROLLPOINT_TEST_EFFECT_LOG``."""

    reproducible_start: ClassVar[bool] = False  # the state names its task

    def start(self, task: TaskRow) -> WorkplaceState:
        state = super().start(task)
        state.task_id = task.task_id  # type: ignore[attr-defined]
        return state

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> WorkplaceState:
        state = super().restore_state(task, exported)
        state.task_id = task.task_id  # type: ignore[attr-defined]
        return state

    def tool_table(self) -> Mapping[str, Tool[WorkplaceState, Any]]:
        # Each tool wrapped where the server runs it (the resources server calls the
        # tools themselves, not Environment.call).
        return {
            name: replace(tool, run=self._logged(tool))
            for name, tool in super().tool_table().items()
        }

    def _logged(self, tool: Tool[WorkplaceState, Any]) -> Callable[[WorkplaceState, Any], str]:
        run = cast(Callable[[WorkplaceState, Any], str], tool.run)

        def logged(state: WorkplaceState, args: Any) -> str:
            before = self.side_effects(state)
            out = run(state, args)
            new = self.side_effects(state) - before
            if new and not replaying():
                task_id = state.task_id  # type: ignore[attr-defined]
                with open(os.environ[LOG_ENV], "ab") as log:
                    for effect in sorted(new.elements()):
                        log.write(orjson.dumps({"task": task_id, "effect": effect}) + b"\n")
            return out

        return logged
