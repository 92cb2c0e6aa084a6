"""A record value made when it is written, not when it is captured: :class:`DeferredValue`.

Justified by ``snapshot_pause`` (``mechanism``: the capture inside the pause takes
references, the dumps happen after it).

Owns the deferral and its memo. A participant captures its records inside the snapshot
pause, and the writer encodes them afterwards in a worker thread
(:mod:`rollpoint.store.participant_state`): work that only turns an already captured,
never changed input into its saved form (a state's JSON dump, compression, base64) can
move out of the pause by handing the writer a :class:`DeferredValue` instead of the
value. The writer makes it on first use (it is a
:class:`~rollpoint.store.record_packs.ValueMadeOnWrite`, the one notion of it the store
has), and a later write of the same record reuses it.

It does not capture anything: what the function reads must already be a copy nobody
changes (the participant takes that copy in the pause). Nor does it know records: which
values are deferred is the participant's choice, and resolving them is the writer's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar, cast

from rollpoint.protocol.errors import RollpointError, SnapshotError
from rollpoint.store.record_packs import ValueMadeOnWrite

T = TypeVar("T")


class DeferredValue(ValueMadeOnWrite, Generic[T]):
    """A JSON value made by ``make()`` the first time it is asked for, then remembered: a
    :class:`~rollpoint.store.record_packs.ValueMadeOnWrite`, so the writer makes it.

    Safe to share between the event loop and the writer's thread without a lock: two
    threads asking at once may both call ``make`` (it must be idempotent: same input,
    same value), and each gets an equal value. ``make`` is dropped once it succeeded, so
    the input it closes over (an uncompressed export) is freed as soon as the value is
    made; a failure keeps it, and the next write tries again.
    """

    __slots__ = ("_make", "_value", "what")

    def __init__(self, make: Callable[[], T], what: str) -> None:
        self._make: Callable[[], T] | None = make
        self._value: T | None = None
        self.what = what
        """Names the value in errors, e.g. ``packed state of rollout r7``."""

    @property
    def made(self) -> bool:
        """The value is made: :meth:`value` returns it without calling anything."""
        return self._make is None

    def value(self) -> T:
        """The value, made now if it was not yet; a failure of ``make`` is a
        :class:`SnapshotError` naming :attr:`what`."""
        make = self._make
        if make is None:
            return cast(T, self._value)  # made: it holds a T
        try:
            value = make()
        except RollpointError as exc:
            raise SnapshotError(f"{self.what} could not be made: {exc.message}") from exc
        except Exception as exc:
            raise SnapshotError(
                f"{self.what} could not be made: {type(exc).__name__}: {exc}"
            ) from exc
        # The value first, then the flag: a reader in another thread that sees the flag
        # cleared also sees the value.
        self._value = value
        self._make = None
        return value

    def __repr__(self) -> str:
        state = "made" if self._make is None else "not made"
        return f"DeferredValue({self.what}, {state})"
