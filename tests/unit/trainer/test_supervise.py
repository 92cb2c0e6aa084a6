"""The trainer loop's supervisor: the main tasks run to their end with the side tasks
beside them, the first error stops every task, and a side task that ends on its own is
done with (a run without a control plane has a stuck-peer watch that returns at once)."""

from __future__ import annotations

import asyncio

import pytest

from rollpoint.trainer import trainer as trainer_module


async def test_a_side_task_that_ends_at_once_is_not_waited_on_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits = 0
    real_wait = asyncio.wait

    async def counted(*args: object, **kw: object) -> object:
        nonlocal waits
        waits += 1
        return await real_wait(*args, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(trainer_module.asyncio, "wait", counted)
    main_done = asyncio.Event()

    async def main() -> None:
        for _ in range(20):  # twenty turns of the loop while the side task is already done
            await asyncio.sleep(0)
        main_done.set()

    async def nothing_to_watch() -> None:
        return None

    await trainer_module._supervise(main=[main()], side=[nothing_to_watch()])
    assert main_done.is_set()
    # Once for the side task's end, once for main's: not once per turn of the loop.
    assert waits <= 2, waits


async def test_a_side_tasks_error_stops_the_main_tasks() -> None:
    cancelled = asyncio.Event()

    async def main() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def failing() -> None:
        raise RuntimeError("the watch saw a stuck peer")

    with pytest.raises(RuntimeError, match="stuck peer"):
        await trainer_module._supervise(main=[main()], side=[failing()])
    assert cancelled.is_set()


async def test_side_tasks_still_running_are_cancelled_when_the_main_tasks_end() -> None:
    cancelled = asyncio.Event()

    async def main() -> None:
        await asyncio.sleep(0)

    async def watch() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    await trainer_module._supervise(main=[main()], side=[watch()])
    assert cancelled.is_set()
