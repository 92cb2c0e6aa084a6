"""The ``fuzz`` marker, and the fuzzers' tally printed at the end of a run."""

from __future__ import annotations

import pytest
from _pytest.terminal import TerminalReporter

from tests.fuzz.control_fuzz import TALLY


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fuzz: generated requests against live servers")


def pytest_terminal_summary(terminalreporter: TerminalReporter) -> None:
    lines = TALLY.lines()
    if lines:
        terminalreporter.section("control API fuzzing")
        for line in lines:
            terminalreporter.write_line(line)
