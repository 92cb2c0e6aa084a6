"""One benchmark result and how the suite prints and saves them."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class BenchResult:
    key: str
    title: str
    figures: dict[str, float | int | str]
    params: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    """How long the item took to run, set by the suite."""


def machine() -> dict[str, Any]:
    import os

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1),
        # Other work on the same cores skews wall times: the load when the results were saved.
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def print_results(results: list[BenchResult], console: Console | None = None) -> None:
    console = console or Console()
    for result in results:
        table = Table(title=f"{result.key}: {result.title}", title_justify="left")
        table.add_column("figure")
        table.add_column("value", justify="right")
        for name, value in result.figures.items():
            table.add_row(name, f"{value:,.3f}" if isinstance(value, float) else str(value))
        params = ", ".join(f"{k}={v}" for k, v in result.params.items())
        params += f"; ran {result.elapsed_s:.1f} s"
        table.caption = params
        console.print(table)


def save_results(
    results: list[BenchResult],
    path: Path | None = None,
    *,
    quick: bool = False,
    merge: bool = False,
) -> Path:
    """Write ``latest.json``: the machine, then one key per item with its figures and params.

    Each item also records when it ran and whether in quick mode; with ``merge`` the items
    of an earlier run that were not rerun are kept.
    """
    path = path or RESULTS / "latest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {}
    if merge and path.exists():
        doc = orjson.loads(path.read_bytes())
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    doc["machine"] = machine()
    for r in results:
        doc[r.key] = {
            "title": r.title,
            "figures": r.figures,
            "params": r.params | {"quick": quick},
            "measured_at": when,
            "elapsed_s": round(r.elapsed_s, 2),
        }
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return path
