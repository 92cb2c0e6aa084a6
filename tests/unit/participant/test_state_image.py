"""The state image: entries remade only when stale, copied by a capture, kept by a sweep."""

from __future__ import annotations

import asyncio

import pytest

from rollpoint.participant import state_image
from rollpoint.participant.state_image import StateImage


class Source:
    """A participant's state: values by key, and a count of entries made."""

    def __init__(self, **values: int) -> None:
        self.values = dict(values)
        self.made: list[str] = []
        self.fail: set[str] = set()

    def make(self, key: str) -> tuple[int] | None:
        if key in self.fail:
            raise RuntimeError(f"cannot make {key}")
        self.made.append(key)
        value = self.values.get(key)
        return None if value is None else (value,)

    def image(self) -> StateImage[tuple[int]]:
        return StateImage(self.make, lambda: list(self.values), name="test")


async def test_an_image_notes_nothing_until_its_first_capture_which_makes_every_entry() -> None:
    source = Source(a=1, b=2)
    image = source.image()
    image.changed("a")
    image.changed("ghost")
    assert image.stale == 0  # idle: a server that never checkpoints keeps nothing
    assert await image.capture() == {"a": (1,), "b": (2,)}
    assert sorted(source.made) == ["a", "b"]
    await image.aclose()


async def test_a_capture_remakes_only_the_changed_entries_and_drops_gone_ones() -> None:
    source = Source(a=1, b=2, c=3)
    image = source.image()
    await image.capture()
    source.made.clear()
    source.values["a"] = 10
    del source.values["c"]
    image.changed("a")
    image.changed("c")
    assert await image.capture() == {"a": (10,), "b": (2,)}
    assert sorted(source.made) == ["a", "c"]  # b did not change: not made again
    await image.aclose()


async def test_a_captured_copy_does_not_follow_later_changes() -> None:
    source = Source(a=1)
    image = source.image()
    copy = await image.capture()
    source.values["a"] = 2
    source.values["b"] = 3
    image.changed("a")
    image.changed("b")
    assert image.capture_now() == {"a": (2,), "b": (3,)}
    assert copy == {"a": (1,)}
    await image.aclose()


async def test_the_sweep_remakes_changed_entries_between_captures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(state_image, "SWEEP_INTERVAL_S", 0.01)
    source = Source(a=1, b=2)
    image = source.image()
    await image.capture()  # starts the sweep
    source.values["a"] = 5
    image.changed("a")
    assert image.stale == 1
    for _ in range(200):
        if image.stale == 0:
            break
        await asyncio.sleep(0.01)
    assert image.stale == 0
    source.made.clear()
    assert await image.capture() == {"a": (5,), "b": (2,)}
    assert source.made == []  # the sweep had made it: the capture only copied
    await image.aclose()


async def test_a_failing_make_leaves_its_key_stale_and_fails_the_capture() -> None:
    source = Source(a=1, b=2)
    image = source.image()
    await image.capture()
    source.fail.add("a")
    image.changed("a")
    with pytest.raises(RuntimeError, match="cannot make a"):
        await image.capture()
    assert image.stale == 1
    source.fail.clear()
    assert await image.capture() == {"a": (1,), "b": (2,)}
    await image.aclose()


async def test_a_large_capture_yields_the_event_loop_between_slices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(state_image, "CAPTURE_SLICE_S", 0.0)  # yield at every clock read
    source = Source(**{f"k{i}": i for i in range(200)})
    image = source.image()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    copy = await image.capture()
    other.cancel()
    assert ticks - before >= 200 // 32  # another task ran between the slices
    assert copy == {key: (value,) for key, value in source.values.items()}
    await image.aclose()


async def test_keep_current_notes_changes_and_sweeps_before_any_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(state_image, "SWEEP_INTERVAL_S", 0.01)
    source = Source(a=1)
    image = source.image()
    image.keep_current()
    source.values["b"] = 2
    image.changed("b")
    for _ in range(200):
        if image.stale == 0 and len(image) == 2:
            break
        await asyncio.sleep(0.01)
    source.made.clear()
    assert await image.capture() == {"a": (1,), "b": (2,)}
    assert source.made == []  # the first capture found everything made already
    await image.aclose()


async def test_a_failing_make_does_not_stop_the_sweep_and_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(state_image, "SWEEP_INTERVAL_S", 0.01)
    source = Source(a=1)
    image = source.image()
    image.keep_current()
    source.fail.add("a")
    source.values["a"] = 2
    image.changed("a")
    await asyncio.sleep(0.1)  # several passes, every one failing
    assert image.stale == 1
    assert len([r for r in caplog.records if "remaking state image" in r.message]) == 1
    source.fail.clear()
    for _ in range(200):
        if image.stale == 0:
            break
        await asyncio.sleep(0.01)
    assert image.capture_now() == {"a": (2,)}
    await image.aclose()
