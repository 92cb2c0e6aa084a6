"""Fixtures shared by the unit tests of several packages."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from rollpoint.tuning.collector_pause import unfreeze


@pytest.fixture
def full_collections() -> Iterator[list[int]]:
    """One entry per generation-2 collection started meanwhile; the collector's thresholds
    and switch are put back afterwards, and nothing is left frozen."""
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    seen: list[int] = []

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 2:
            seen.append(2)

    gc.callbacks.append(record)
    yield seen
    gc.callbacks.remove(record)
    gc.set_threshold(*thresholds)
    unfreeze()  # a schedule's collections freeze their survivors
    (gc.enable if enabled else gc.disable)()
