"""The suite's tiers: every test carries exactly one tier marker, and the costly ones run first.

A tier says what a test costs and what it waits on (pyproject.toml registers them):

- ``unit``: one module's logic in the test process (tests/unit);
- ``integration``: real servers on loopback as threads of the test process (tests/integration,
  tests/scenarios, tests/fuzz);
- ``process``: real server or CLI processes (files in tests/integration that start them say
  so with ``pytestmark = pytest.mark.process``);
- ``chaos``: processes killed and rerun (tests/chaos, the ``rollpoint chaos`` command);
- ``ray``: a local two-node Ray cluster (tests/ray);
- ``examples``: the packages under examples/, installed (tests/examples);
- ``engine``: a real policy engine, llama.cpp's server on the CPU (tests/engine).

A test with no tier marker of its own gets its folder's; one with two is a usage error.
Select a tier with ``-m``: ``pytest -m unit``, ``pytest -m "process or chaos"``.

Under pytest-xdist (``make test`` runs ``-n 4 --dist loadgroup``) the order of the items is
the order work is handed out: the tiers that wait longest go first, so the many short unit
tests fill the workers' last minutes instead of one long chaos trial starting last. Tests
that share an expensive module or session fixture carry ``pytest.mark.xdist_group`` (one
worker makes the fixture once); the ray tier is one group, its cluster made once, and so is the engine tier.
A worker refuses to run when those groups would be ignored (:func:`pytest_collection_finish`).

With ``ROLLPOINT_TEST_CPU=<file>`` each test appends a JSON line there: its node id, its
worker, when it started (Unix time), its wall seconds and the CPU seconds it cost (this
process and every child it waited for: the servers a ``rollpoint run`` started count once
that run is reaped), to find what the suite's CPU goes to and whether a worker idles at the
end (:func:`pytest_runtest_protocol`).
"""

from __future__ import annotations

import gc
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

TIERS = ("engine", "chaos", "ray", "process", "examples", "integration", "unit")
"""Every tier, in the order their tests are handed out (longest waits first)."""

FOLDER_TIERS = {
    "unit": "unit",
    "integration": "integration",
    "scenarios": "integration",
    "fuzz": "integration",
    "chaos": "chaos",
    "ray": "ray",
    "examples": "examples",
    "engine": "engine",
}

TESTS = Path(__file__).parent


def _folder_tier(item: pytest.Item) -> str:
    relative = item.path.relative_to(TESTS)
    tier = FOLDER_TIERS.get(relative.parts[0])
    if tier is None:
        raise pytest.UsageError(f"{relative}: tests/{relative.parts[0]} has no tier: add it")
    return tier


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tier_of: dict[str, str] = {}
    for item in items:
        own = {m.name for m in item.iter_markers() if m.name in TIERS}
        if len(own) > 1:
            raise pytest.UsageError(f"{item.nodeid}: more than one tier: {sorted(own)}")
        tier = own.pop() if own else _folder_tier(item)
        if not item.get_closest_marker(tier):
            item.add_marker(tier)
        if tier in ("ray", "engine") and not item.get_closest_marker("xdist_group"):
            # One cluster, one engine process (a CPU-bound one: two would halve each).
            item.add_marker(pytest.mark.xdist_group(tier))
        tier_of[item.nodeid] = tier
    # A stable sort: within a tier, collection order (a file's tests stay together).
    items.sort(key=lambda item: TIERS.index(tier_of[item.nodeid]))


COLLECTOR_BACK_WITHIN_S = 2.0
"""How long after a test its checkpoints' collector holds may still be given back: a hold is
released 0.25 s after its pause ends (``COLLECTOR_RELEASE_DELAY_S``), on a loaded machine
later."""


@pytest.fixture(autouse=True)
def _collector_left_as_found() -> Iterator[None]:
    """A test that leaves the cyclic collector off fails itself, named, instead of every later
    test on its worker that checks the collector (CI once failed eleven unit tests that way,
    the culprit unnamed): the collector is turned back on for them."""
    enabled = gc.isenabled()
    yield
    if not enabled or gc.isenabled():
        return
    deadline = time.monotonic() + COLLECTOR_BACK_WITHIN_S
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.02)  # a server thread's loop gives its hold back on its own
    if not gc.isenabled():
        gc.enable()
        pytest.fail(
            f"the cyclic garbage collector was left off {COLLECTOR_BACK_WITHIN_S:g} s after "
            "this test (a collector pause or hold never given back)"
        )


LOST_GROUPS = pytest.StashKey[str]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``--dist loadgroup``, notes on a worker whether xdist's grouping took.

    xdist marks a grouped test by appending ``@group`` to its node id on the worker, and the
    scheduler hands out tests by that suffix. With pytest 9.2 the mutation no longer takes
    effect (pytest-xdist#1386): nothing fails, every group is split across the workers, and
    each worker builds its own copy of every shared fixture (a chaos run, a Ray cluster, an
    engine), which cost the suite minutes unseen. pyproject.toml pins pytest below 9.2 for
    it; if a later pytest or xdist breaks it again, every grouped test fails saying so
    (:func:`pytest_runtest_setup`: an error raised here would reach the console only as an
    xdist crash).
    """
    if not getattr(session.config.option, "loadgroup", False):
        return  # not an xdist worker under --dist loadgroup
    lost = [
        item.nodeid
        for item in session.items
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid.rpartition("]")[2]
    ]
    if lost:
        session.config.stash[LOST_GROUPS] = (
            f"--dist loadgroup ignored the xdist_group of {len(lost)} tests: this pytest and "
            "pytest-xdist do not group (pytest-xdist#1386); pin a pair that does"
        )


def pytest_runtest_setup(item: pytest.Item) -> None:
    lost = item.config.stash.get(LOST_GROUPS, None)
    if lost is not None and item.get_closest_marker("xdist_group"):
        pytest.fail(lost, pytrace=False)


CPU_LOG = "ROLLPOINT_TEST_CPU"


def _cpu_seconds() -> float:
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Under ``ROLLPOINT_TEST_CPU``, one line a test: what it cost in CPU and in time."""
    path = os.environ.get(CPU_LOG)
    if not path:
        return (yield)
    cpu, wall = _cpu_seconds(), time.monotonic()
    try:
        return (yield)
    finally:
        line = {
            "test": item.nodeid,
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "start": round(time.time() - (time.monotonic() - wall), 3),
            "wall_s": round(time.monotonic() - wall, 3),
            "cpu_s": round(_cpu_seconds() - cpu, 3),
        }
        with open(path, "ab") as out:  # one short append a line: workers may share the file
            out.write(orjson.dumps(line) + b"\n")
