"""The seam between checkpoints and the performance tricks: events a source emits, heard by
whichever listeners its process installed.

Owns the process-wide registry of :class:`CheckpointListener` s and the four events a
*source* emits: a participant's fence, or the trainer's snapshot coordinator (any object
that can be weakly referenced; a listener keys what it keeps by it):

- :func:`in_use`: checkpoints are in use on this source (emitted once, from the event loop
  that serves it: a listener may start tasks there);
- :func:`hold`: a checkpoint holds the source (its pause starts);
- :func:`release`: the hold ended (the pause is over);
- :func:`closed`: the source stopped (awaited: a listener stops what it started).

Without a listener, emitting is a check of an empty tuple: the fence emits on its pause
path, and a process that installed nothing pays nothing there. Listeners are installed by
each process's entry point (:func:`rollpoint.tuning.install`), not by the source: a fence
and a coordinator know that checkpoints hold them, not what a trick does about it.

And the record values a participant hands its snapshot writer, named here so that a
participant (the SDK, a built-in server) reaches every trick through the seam: a value made
when it is written, not inside the pause (:class:`DeferredValue`, from
:mod:`rollpoint.tuning.deferred_value`), and JSON encoded once and kept (:func:`encoded`,
:func:`encoded_or_itself`, from :mod:`rollpoint.tuning.encoded_json`). They need no
installing: each is a value the writer copies or makes, whoever wrote it.

It does not own any trick (:mod:`rollpoint.tuning.collector_listener` is the one listener
today), nor when a source emits (the fence's phase machine, the coordinator's save).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TypeVar

from rollpoint.tuning.deferred_value import DeferredValue
from rollpoint.tuning.encoded_json import encoded, encoded_or_itself

__all__ = [
    "CheckpointListener",
    "DeferredValue",
    "add_listener",
    "closed",
    "encoded",
    "encoded_or_itself",
    "hold",
    "in_use",
    "listeners",
    "listening",
    "release",
    "remove_listener",
]


class CheckpointListener:
    """Hears a process's checkpoint events; each method is a no-op here, a listener
    overrides those it needs. Called on the source's event loop thread (a process may run
    several loops, one per server thread: a listener that keeps state per source guards it)."""

    def in_use(self, source: object) -> None:
        """Checkpoints are in use on ``source``; called from its running event loop."""

    def hold(self, source: object) -> None:
        """A checkpoint holds ``source``: its pause starts."""

    def release(self, source: object) -> None:
        """The hold on ``source`` ended: its pause is over."""

    async def closed(self, source: object) -> None:
        """``source`` stopped; nothing more comes from it."""


L = TypeVar("L", bound=CheckpointListener)

_LOCK = threading.Lock()
_LISTENERS: tuple[CheckpointListener, ...] = ()
"""Replaced, never changed in place: an emitter iterates the tuple it read, unlocked."""


def add_listener(listener: CheckpointListener) -> None:
    """Hear every event emitted from now on (a listener already added is not added twice)."""
    global _LISTENERS
    with _LOCK:
        if not any(known is listener for known in _LISTENERS):
            _LISTENERS = (*_LISTENERS, listener)


def remove_listener(listener: CheckpointListener) -> None:
    """Stop hearing events (a listener not added is ignored)."""
    global _LISTENERS
    with _LOCK:
        _LISTENERS = tuple(known for known in _LISTENERS if known is not listener)


def listeners() -> tuple[CheckpointListener, ...]:
    """The listeners installed in this process, in the order they hear events."""
    return _LISTENERS


@contextlib.contextmanager
def listening(listener: L) -> Iterator[L]:
    """``listener`` alone hears the events emitted inside; the listeners installed before
    are set aside meanwhile and back after (for tests: one that brings its own collector
    schedule must not share the fences with the process's)."""
    global _LISTENERS
    with _LOCK:
        before, _LISTENERS = _LISTENERS, (listener,)
    try:
        yield listener
    finally:
        with _LOCK:
            _LISTENERS = before


# --- emitting ----------------------------------------------------------------------------
# Each reads the tuple once: a listener added meanwhile hears the next event, not half of one.


def in_use(source: object) -> None:
    """Checkpoints are in use on ``source`` (call from its running event loop, once)."""
    found = _LISTENERS
    if found:
        for listener in found:
            listener.in_use(source)


def hold(source: object) -> None:
    """A checkpoint holds ``source``."""
    found = _LISTENERS
    if found:
        for listener in found:
            listener.hold(source)


def release(source: object) -> None:
    """The hold on ``source`` ended."""
    found = _LISTENERS
    if found:
        for listener in found:
            listener.release(source)


async def closed(source: object) -> None:
    """``source`` stopped; every listener is awaited in turn."""
    for listener in _LISTENERS:
        await listener.closed(source)
