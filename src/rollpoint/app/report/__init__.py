"""``rollpoint report``: a run at a glance, as one self-contained HTML page.

The package has one module per noun: :mod:`.run_record` reads what the run left behind
(``metrics.jsonl``, ``run_events.jsonl``, the snapshot store), :mod:`.figures` draws the plots
as SVG with matplotlib, :mod:`.page` lays out the HTML. :func:`read_run` and :func:`write_report` are the API.
matplotlib comes with the ``report`` extra (``pip install 'rollpoint[report]'``); the
rest of rollpoint never imports this package.
"""

from __future__ import annotations

from pathlib import Path

from rollpoint.app.report.page import render_page
from rollpoint.app.report.run_record import RunRecord, read_run

__all__ = ["RunRecord", "read_run", "render_page", "write_report"]

REPORT_FILE = "report.html"


def write_report(record: RunRecord, out: Path | None = None) -> Path:
    """Write the page of ``record`` to ``out`` (default WORKDIR/report.html), whole or not
    at all (a browser reloading it never sees half a page)."""
    target = out or record.workdir / REPORT_FILE
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(render_page(record), encoding="utf-8")
    tmp.replace(target)
    return target
