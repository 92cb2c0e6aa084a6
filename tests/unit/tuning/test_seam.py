"""The checkpoint seam: events a fence or the coordinator emits, and the collector's listener."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from pathlib import Path

import pytest

import rollpoint.tuning
from rollpoint.participant.control_settings import ControlSettings
from rollpoint.participant.fence import Fence
from rollpoint.protocol.control import PrepareRequest, ResumeRequest
from rollpoint.tuning import seam
from rollpoint.tuning.collector_listener import CollectorListener, installed
from rollpoint.tuning.collector_schedule import COLLECTOR_RELEASE_DELAY_S, CollectorSchedule
from tests.unit.participant.fake_participant import FakeParticipant


class Recorder(seam.CheckpointListener):
    def __init__(self) -> None:
        self.heard: list[tuple[str, object]] = []

    def in_use(self, source: object) -> None:
        self.heard.append(("in_use", source))

    def hold(self, source: object) -> None:
        self.heard.append(("hold", source))

    def release(self, source: object) -> None:
        self.heard.append(("release", source))

    async def closed(self, source: object) -> None:
        await asyncio.sleep(0)  # awaited, not just called
        self.heard.append(("closed", source))


class Source:
    """A source of checkpoint events that is neither a fence nor a coordinator."""


@pytest.fixture
def fence(tmp_path: Path) -> Fence:
    participant = FakeParticipant()
    participant.state = {"r1#0": 1}
    return Fence(participant, ControlSettings("t", str(tmp_path / "snapshots")))


def prepare(cid: str) -> PrepareRequest:
    return PrepareRequest(checkpoint_id=cid, deadline_ts=time.time() + 30)


# --- nothing installed -------------------------------------------------------------------


async def test_with_no_listener_emitting_does_nothing(
    fence: Fence, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seam, "_LISTENERS", ())
    schedule_before = gc.get_threshold()
    source = Source()
    seam.in_use(source)
    seam.hold(source)
    assert gc.isenabled()
    seam.release(source)
    await seam.closed(source)
    # A fence's whole pause: the collector is never touched.
    fence.status()
    await fence.prepare(prepare("c1"))
    assert gc.isenabled() and gc.get_threshold() == schedule_before
    await fence.resume(ResumeRequest(checkpoint_id="c1"))
    await fence.aclose()
    assert gc.isenabled() and gc.get_threshold() == schedule_before


# --- the registry ------------------------------------------------------------------------


async def test_listeners_hear_every_event_in_order_and_closed_is_awaited() -> None:
    first, second = Recorder(), Recorder()
    source = Source()
    with seam.listening(first):
        seam.add_listener(second)
        seam.add_listener(second)  # once
        assert seam.listeners() == (first, second)
        seam.in_use(source)
        seam.hold(source)
        seam.release(source)
        await seam.closed(source)
        seam.remove_listener(second)
        seam.remove_listener(second)  # not there: ignored
        seam.hold(source)
    events = [("in_use", source), ("hold", source), ("release", source), ("closed", source)]
    assert second.heard == events
    assert first.heard == [*events, ("hold", source)]


def test_listening_sets_the_installed_listeners_aside_and_puts_them_back() -> None:
    outer, inner = Recorder(), Recorder()
    with seam.listening(outer):
        with seam.listening(inner):
            assert seam.listeners() == (inner,)
            seam.hold(Source())
        assert seam.listeners() == (outer,)
    assert outer.heard == [] and len(inner.heard) == 1


def test_install_twice_registers_once() -> None:
    with seam.listening(Recorder()):
        rollpoint.tuning.install()
        rollpoint.tuning.install()
        collectors = [x for x in seam.listeners() if isinstance(x, CollectorListener)]
        assert len(collectors) == 1
        rollpoint.tuning.install()
        assert [x for x in seam.listeners() if isinstance(x, CollectorListener)] == collectors


# --- the fence's events ------------------------------------------------------------------


async def test_a_fence_emits_in_use_once_on_its_loop_and_nothing_once_closed(
    fence: Fence,
) -> None:
    recorder = Recorder()
    with seam.listening(recorder):
        fence.status()
        fence.status()
        await fence.prepare(prepare("c1"))  # its lease is a first use too
        await fence.resume(ResumeRequest(checkpoint_id="c1"))
        await fence.aclose()
        fence.status()
    assert recorder.heard == [
        ("in_use", fence),
        ("hold", fence),
        ("release", fence),
        ("closed", fence),
    ]


def test_a_fence_built_outside_a_loop_emits_in_use_only_from_one(fence: Fence) -> None:
    recorder = Recorder()
    with seam.listening(recorder):
        fence.status()  # an app factory's loop, or none: not the one serving the fence
    assert recorder.heard == []


# --- the collector's listener ------------------------------------------------------------


async def test_installed_the_fences_pause_holds_the_collector_and_in_use_attaches(
    fence: Fence, full_collections: list[int]
) -> None:
    schedule = CollectorSchedule()
    before = gc.get_threshold()
    with installed(schedule) as listener:
        assert listener.collector(fence) is None  # made by the first event
        fence.status()
        assert schedule.attached and gc.get_threshold()[2] > 10**9
        collector = listener.collector(fence)
        assert collector is not None and collector.started
        await fence.prepare(prepare("c1"))
        assert not gc.isenabled() and collector.held
        await fence.resume(ResumeRequest(checkpoint_id="c1"))
        assert not gc.isenabled()  # not inside the resume: given back a little later
        await asyncio.sleep(COLLECTOR_RELEASE_DELAY_S + 0.1)
        assert gc.isenabled() and not collector.held
        await fence.aclose()
        assert listener.collector(fence) is None  # dropped at close
        assert not schedule.attached and gc.get_threshold() == before


async def test_a_hold_whose_collector_never_started_is_given_back_at_once(
    full_collections: list[int],
) -> None:
    # The coordinator outside a trainer run: nothing would ever close its collector.
    schedule = CollectorSchedule()
    source = Source()
    with installed(schedule) as listener:
        seam.hold(source)
        assert not gc.isenabled()
        seam.release(source)
        assert gc.isenabled()
        collector = listener.collector(source)
        assert collector is not None and not collector.started and not collector.held
        # Once in use (a trainer run), the release waits as the fence's does.
        seam.in_use(source)
        assert collector.started and schedule.attached
        seam.hold(source)
        seam.release(source)
        assert not gc.isenabled()
        await asyncio.sleep(COLLECTOR_RELEASE_DELAY_S + 0.1)
        assert gc.isenabled()
        await seam.closed(source)
        assert listener.collector(source) is None and not schedule.attached


async def test_closing_gives_a_hold_back(full_collections: list[int]) -> None:
    source = Source()
    with installed(CollectorSchedule()):
        seam.in_use(source)
        seam.hold(source)
        assert not gc.isenabled()
        await seam.closed(source)
        assert gc.isenabled()


def test_the_listener_keeps_no_source_alive() -> None:
    source = Source()
    with installed(CollectorSchedule()) as listener:
        seam.hold(source)
        seam.release(source)
        assert listener.collector(source) is not None
        gone = weakref.ref(source)
        del source
        gc.collect()
        assert gone() is None
