"""Random closes, opens, arrivals, finishes and cancels against one admission gate.

Callers use the gate as the servers do: ``admit()`` (model and resources calls: they wait
while closed and count as in flight until they finish) and ``wait_open()`` (an agent
session pausing at its turn boundary). After every step the loop settles; the gate's counts
must then match what the callers themselves report, nobody enters while it is closed, and
nobody waits while it is open.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rollpoint.participant.admission_gate import AdmissionGate


@dataclass
class _Caller:
    kind: str
    """``admit`` or ``wait_open``."""
    task: asyncio.Task[None] | None = None
    inside: bool = False
    passed: bool = False
    release: asyncio.Event = field(default_factory=asyncio.Event)


class GateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.gate = self.loop.run_until_complete(self._make_gate())
        self.callers: list[_Caller] = []
        self.entered_while_closed = 0
        self.wakes = 0

    @staticmethod
    async def _make_gate() -> AdmissionGate:
        return AdmissionGate()

    def settle(self) -> None:
        async def spin() -> None:
            for _ in range(6):
                await asyncio.sleep(0)

        self.loop.run_until_complete(spin())

    async def _admitted(self, caller: _Caller) -> None:
        async with self.gate.admit():
            if not self.gate.is_open:
                self.entered_while_closed += 1
            caller.inside = True
            try:
                await caller.release.wait()
            finally:
                caller.inside = False
        caller.passed = True

    async def _paused(self, caller: _Caller) -> None:
        await self.gate.wait_open()
        if not self.gate.is_open:
            self.entered_while_closed += 1
        caller.passed = True

    async def _watch(self) -> None:
        if await self.gate.wait_changed(None):
            self.wakes += 1

    def _live(self) -> list[_Caller]:
        return [c for c in self.callers if c.task is not None and not c.task.done()]

    @rule()
    def close(self) -> None:
        self.gate.close()
        self.settle()

    @rule()
    def open(self) -> None:
        self.gate.open()
        self.settle()

    @rule()
    def open_and_close_before_anyone_runs(self) -> None:
        # Released waiters must look again: the gate closed before they got a turn.
        self.gate.open()
        self.gate.close()
        self.settle()

    @rule(kind=st.sampled_from(["admit", "admit", "wait_open"]))
    def arrive(self, kind: str) -> None:
        caller = _Caller(kind)
        body = self._admitted(caller) if kind == "admit" else self._paused(caller)
        caller.task = self.loop.create_task(body)
        self.callers.append(caller)
        self.settle()

    @precondition(lambda self: any(c.inside for c in self.callers))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        inside = [c for c in self.callers if c.inside]
        data.draw(st.sampled_from(inside)).release.set()
        self.settle()

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        caller = data.draw(st.sampled_from(self._live()))
        assert caller.task is not None
        caller.task.cancel()
        self.settle()

    @rule()
    def a_change_wakes_a_watcher(self) -> None:
        watcher = self.loop.create_task(self._watch())
        self.settle()
        before = self.wakes
        # Any change wakes it: a close or open that moves the state, else the owner's notify.
        if self.gate.is_open:
            self.gate.close()
        else:
            self.gate.open()
        self.settle()
        assert watcher.done() and self.wakes == before + 1

    @invariant()
    def counts_match_the_callers(self) -> None:
        live = self._live()
        inside = sum(c.inside for c in self.callers)
        held = sum(1 for c in live if not c.inside)
        assert self.gate.in_flight == inside
        assert self.gate.waiting == held
        assert self.gate.drained == (not self.gate.is_open and inside == 0)

    @invariant()
    def nobody_enters_while_closed_nor_waits_while_open(self) -> None:
        assert self.entered_while_closed == 0
        if self.gate.is_open:
            assert self.gate.waiting == 0

    @invariant()
    def a_waiting_caller_has_not_passed(self) -> None:
        for caller in self._live():
            if not caller.inside:
                assert not caller.passed

    def teardown(self) -> None:
        for caller in self.callers:
            if caller.task is not None:
                caller.task.cancel()
        self.gate.open()
        self.settle()
        assert (self.gate.in_flight, self.gate.waiting) == (0, 0)
        self.loop.close()


GateMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_admission_gate_state_machine = GateMachine.TestCase
