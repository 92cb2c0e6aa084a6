"""``rollpoint report`` of real runs, opened in headless Chromium.

Each test runs the real command on loopback (a short job; one of them SIGKILLed after a
snapshot and rerun to the end), writes the report with the real ``rollpoint report``, and
opens the page in Debian's ``chromium`` driven by playwright: no console error, no request
leaves the file (the page is self-contained), the timeline and the pause histogram drew
non-empty SVG, every snapshot attempt of ``metrics.jsonl`` has its mark in the DOM, and a
screenshot is saved beside the run (``<tmp>/report.png``). Without Chromium the tests say
why and are skipped; ``.ci/run`` installs it so CI always has it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support.job_config import write_job_config
from tests.support.run_process import RunProcess

# One worker runs the file: the module's browser is started once.
pytestmark = [pytest.mark.process, pytest.mark.xdist_group("report_browser")]

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _chromium() -> str | None:
    for candidate in ("/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    path = _chromium()
    if path is None:
        pytest.skip(
            "no chromium: install Debian's package (apt-get install chromium), as .ci/run does"
        )
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
    with sync_api.sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


def write_config(tmp_path: Path, **overrides: object) -> Path:
    return write_job_config(
        tmp_path,
        **{
            "tasks": 16,
            "policy": {"latency_ms": 40, "error_rate": 0},
            "snapshot": {"every_seconds": 0.3},
            **overrides,
        },
    )


def rollpoint(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollpoint", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def snapshot_ids(workdir: Path) -> list[str]:
    lines = (workdir / "metrics.jsonl").read_bytes().splitlines()
    return [orjson.loads(line)["snapshot_id"] for line in lines]


def report_of(workdir: Path) -> Path:
    result = rollpoint("report", str(workdir), "--json")
    assert result.returncode == 0, result.stderr
    return Path(orjson.loads(result.stdout)["report"])


@dataclass
class Opened:
    page: Any
    errors: list[str]
    """Console errors and uncaught exceptions."""
    outside: list[str]
    """URLs the page asked for beyond its own file (refused)."""


def open_page(browser: Any, page_path: Path, screenshot: Path) -> Opened:
    """The page loaded with its console errors and outside requests collected, and a
    full-page screenshot taken."""
    page = browser.new_page(viewport={"width": 1150, "height": 900})
    errors: list[str] = []
    outside: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))

    def route(r: Any) -> None:
        if r.request.url.startswith("file://"):
            r.continue_()
        else:
            outside.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.goto(page_path.resolve().as_uri())
    page.screenshot(path=str(screenshot), full_page=True)
    return Opened(page, errors, outside)


def assert_plots_rendered(opened: Opened, ids: list[str]) -> None:
    assert opened.errors == [], opened.errors
    assert opened.outside == [], f"the page asked the network for {opened.outside}"
    page = opened.page
    for figure in ("timeline", "pause-histogram", "pause-sessions", "in-flight"):
        box = page.locator(f"#{figure} svg").bounding_box()
        assert box is not None and box["width"] > 300 and box["height"] > 150, (figure, box)
        drawn = page.evaluate(
            f"document.querySelectorAll('#{figure} svg path, #{figure} svg use').length"
        )
        assert drawn > 10, f"{figure}: {drawn} shapes"
    marks = page.evaluate(
        'ids => ids.filter(id => !document.querySelector(`#timeline svg g[id="${id}"] title`))',
        ids,
    )
    assert marks == [], f"snapshots without a mark on the timeline: {marks}"
    assert page.locator("#pause-histogram svg text", has_text="p99").count() == 1


def state_of(opened: Opened) -> str:
    text: str = opened.page.locator("dl.summary dt:text-is('state') + dd").inner_text()
    return text


@pytest.mark.timeout(300)
def test_report_of_a_crashed_and_resumed_run_shows_the_restore(
    browser: Any, tmp_path: Path
) -> None:
    """With the journal on: the page also lists each server's journal, the marks the kept
    snapshots hold for it and the turns the restore took from the agents' journals. The
    rerun's page is a finished run's: every plot drawn, the state "finished"."""
    config = write_config(tmp_path, journal={"enabled": True})
    workdir = tmp_path / "run"
    first = RunProcess(config)
    try:
        first.wait_until(
            lambda: any((workdir / "checkpoints").glob("step-*.json")), "a train checkpoint"
        )
        published = workdir / "snapshots" / "snapshots"
        before = {p.parent.name for p in published.glob("*/manifest.json")}
        first.wait_until(
            lambda: bool({p.parent.name for p in published.glob("*/manifest.json")} - before),
            "a snapshot after the checkpoint",
        )
    finally:
        survivors = first.kill()
    assert survivors == []
    # The crashed run's page: no run_end, so it reads as crashed.
    crashed = open_page(browser, report_of(workdir), tmp_path / "crashed.png")
    assert crashed.errors == []
    assert state_of(crashed) == "crashed or still running"

    again = rollpoint("run", str(config))
    assert again.returncode == 0, again.stderr
    assert "resumed from snapshot" in again.stderr
    opened = open_page(browser, report_of(workdir), tmp_path / "report.png")
    assert_plots_rendered(opened, snapshot_ids(workdir))
    assert state_of(opened) == "finished"
    assert (tmp_path / "report.png").stat().st_size > 20_000
    page = opened.page
    restores = page.locator("h2:text('Restores') + table tbody tr")
    assert restores.count() == 1
    cells = restores.first.locator("td").all_inner_texts()
    restored_from = cells[1]
    assert restored_from in again.stderr
    assert page.locator("#timeline svg text", has_text=f"restore {restored_from}").count() == 1
    # The restored snapshot has its mark, even when the kill came before its metrics line.
    assert page.locator(f'#timeline svg g[id="{restored_from}"] title').count() == 1
    # The rerun's mark, its legend entry, and where the killed run's records stop.
    assert page.locator("#timeline svg text", has_text="rerun").count() == 2
    assert page.locator("#timeline svg text", has_text="last sign of life").count() == 1
    # The journals: one row per server, as the store holds them; the marks every kept
    # snapshot saved; the restore's turns from the journal, as its line said.
    taken = re.search(r"(\d+) replayed from the journal", again.stderr)
    assert taken is not None, again.stderr
    assert cells[8] == taken.group(1)
    store = orjson.loads(rollpoint("inspect", str(workdir), "--json").stdout)
    kept = [s["id"] for s in store["snapshots"]]
    rows = page.locator("h2:text('Journals') + table tbody tr")
    shown = {}
    for i in range(rows.count()):
        row = rows.nth(i).locator("td").all_inner_texts()
        shown[row[0]] = row
    assert set(shown) == {f"{j['kind']}/{j['instance']}" for j in store["journals"]}
    assert len(shown) == 6  # model, resources and agent servers of two replicas
    for j in store["journals"]:
        row = shown[f"{j['kind']}/{j['instance']}"]
        assert row[1:4] == [str(j["records"]), str(j["bytes"]), str(j["segments"])]
        assert all(f"{sid}: segment " in row[5] for sid in kept), (row, kept)
    at_restore = [shown[name][6] for name in shown if name.startswith("agent/")]
    turns = [
        re.fullmatch(r"(\d+) turns, \d+ finished replies; read back in \d+ ms", cell)
        for cell in at_restore
    ]
    assert all(turns), at_restore
    assert sum(int(m.group(1)) for m in turns if m) == int(taken.group(1))
    # Every server read its journal back as it started, and the page says how long.
    others = [shown[name][6] for name in shown if not name.startswith("agent/")]
    assert all(re.fullmatch(r"read back in \d+ ms", cell) for cell in others), others
