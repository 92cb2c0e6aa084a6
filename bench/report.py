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


def machine() -> dict[str, Any]:
    import os

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
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
        table.caption = params
        console.print(table)


def save_results(results: list[BenchResult], path: Path | None = None) -> Path:
    path = path or RESULTS / "latest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine()} | {
        r.key: {"title": r.title, "figures": r.figures, "params": r.params} for r in results
    }
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return path
