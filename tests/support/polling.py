"""Waiting for a condition another task or process brings about, with a deadline."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

POLL_S = 0.02


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], what: str, *, within_s: float = 5.0
) -> float:
    """Poll ``check`` (sync or async) until it is true; return the seconds it took.

    Raises ``AssertionError`` naming ``what`` when it is still false after ``within_s``.
    """
    started = time.monotonic()
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return time.monotonic() - started
        if time.monotonic() - started > within_s:
            raise AssertionError(f"never happened within {within_s}s: {what}")
        await asyncio.sleep(POLL_S)
