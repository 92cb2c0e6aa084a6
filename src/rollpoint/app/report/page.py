"""The report page: one self-contained HTML file for a :class:`RunRecord`.

Owns the page's layout and tables: a summary of the run, the figures of
:mod:`rollpoint.app.report.figures` inlined as SVG, the snapshot attempts (a failed one with
its reason), the restores (continued, restarted, adopted, requeued, policy calls kept, turns
taken from the journal and calls re-done), each participant's journal (size, records, the
kept snapshots' marks, what the last restore took from it), what happened to replicas, the
latest snapshot's contents as ``rollpoint inspect`` shows them, and the config the run used. Nothing on the page loads from anywhere:
one inline stylesheet, no script, so it opens from a file, offline, in any browser. A
workdir with no snapshot gets a page that says so. Every value from the run is escaped.
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Iterable, Sequence
from typing import Any

import yaml

from rollpoint import __version__
from rollpoint.app.report import figures
from rollpoint.app.report.run_record import RunRecord
from rollpoint.trainer.run_events import ReplicaDown

MAX_TABLE_ROWS = 300
"""Rows shown per table (failed snapshots first, then the newest): a long run's page stays
readable and small; the files keep everything."""

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1100px;
       padding: 0 16px; color: #1d1d1f; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
.sub { color: #666; margin-top: 0; }
.figure svg { width: 100%; height: auto; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; }
table { border-collapse: collapse; font-size: 12.5px; margin: 8px 0; }
th, td { border-bottom: 1px solid #e4e4e4; padding: 3px 10px 3px 0; text-align: left;
         vertical-align: top; }
th { color: #555; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.failed { color: #b21f1f; } .published { color: #1f7a43; }
.note { background: #fff7e0; border-left: 3px solid #e0a800; padding: 8px 12px; }
.empty { background: #f3f3f3; padding: 14px; font-size: 15px; }
pre { background: #f6f6f6; padding: 10px; overflow-x: auto; font-size: 12px; }
dl.summary { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; }
dl.summary dt { color: #555; }
"""


def _e(value: object) -> str:
    return html.escape(str(value))


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _table(
    headers: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    numeric: frozenset[int] = frozenset(),
) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            cls = ' class="num"' if i in numeric else ""
            cells.append(f"<td{cls}>{cell}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _capped(items: list[Any], what: str) -> tuple[list[Any], str]:
    if len(items) <= MAX_TABLE_ROWS:
        return items, ""
    return items[:MAX_TABLE_ROWS], f"<p>and {len(items) - MAX_TABLE_ROWS} more {what}</p>"


def render_page(record: RunRecord) -> str:
    parts = [_header(record)]
    if not record.snapshots and not record.inspect.get("snapshots"):
        parts.append(
            '<p class="empty" id="no-snapshots">This run has no snapshots yet: nothing was '
            "checkpointed, so a crash now would start every episode over.</p>"
        )
    else:
        parts += [
            "<h2>Timeline</h2>",
            f'<div class="figure" id="timeline">{figures.timeline(record)}</div>',
            '<div class="pair">',
            f'<div class="figure" id="pause-histogram">{figures.pause_histogram(record)}</div>',
            f'<div class="figure" id="pause-sessions">{figures.pause_against_sessions(record)}</div>',
            "</div>",
        ]
    if record.samples:
        parts += [
            "<h2>Episodes in flight</h2>",
            f'<div class="figure" id="in-flight">{figures.episodes_in_flight(record)}</div>',
        ]
    parts += [
        _restores(record),
        _journals(record),
        _replicas(record),
        _snapshot_table(record),
        _latest(record),
        _config(record),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>rollpoint report: {_e(record.workdir)}</title>"
        f"<style>{_STYLE}</style></head><body>{''.join(parts)}"
        f'<p class="sub">rollpoint {_e(__version__)}</p></body></html>\n'
    )


def _header(record: RunRecord) -> str:
    published = sum(s.published for s in record.snapshots)
    failed = len(record.snapshots) - published
    rows = [
        ("state", record.state),
        (
            "runs",
            f"{len(record.segments)} (a first run and {max(0, len(record.segments) - 1)} reruns)",
        ),
        ("snapshots", f"{published} published, {failed} failed"),
        ("train steps", _train_steps(record)),
        ("restores", str(len(record.restores))),
        ("snapshot store", record.store_root),
    ]
    if record.snapshots:
        p50, p99 = figures.pause_percentiles(record)
        rows.append(("pause", f"p50 {p50:.1f} ms, p99 {p99:.1f} ms"))
    if record.segments:
        rows.append(("started", _when(record.segments[0].start.ts)))
        end = record.segments[-1].end
        if end is not None:
            rows.append(("finished", f"{end.episodes} episodes, {end.train_steps} train steps"))
    summary = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in rows)
    notes = []
    if record.newer_lines:
        notes.append(
            f"{record.newer_lines} lines of run_events.jsonl are of a newer format than this "
            "rollpoint reads; they are left out."
        )
    if record.skipped_lines:
        notes.append(f"{record.skipped_lines} lines of run_events.jsonl could not be read (torn).")
    if record.inspect_error:
        notes.append(f"the snapshot store could not be read: {record.inspect_error}")
    if not record.segments:
        notes.append(
            "no run_events.jsonl: restores, train steps and replicas are not shown (a run of an "
            "older rollpoint)."
        )
    note = "".join(f'<p class="note">{_e(n)}</p>' for n in notes)
    return (
        f"<h1>rollpoint run report</h1><p class='sub'>{_e(record.workdir)}</p>"
        f'<dl class="summary">{summary}</dl>{note}'
    )


def _train_steps(record: RunRecord) -> str:
    steps = [t.step for t in record.train_steps]
    again = len(steps) - len(set(steps))
    text = f"{len(set(steps))}"
    return text + (f" ({again} trained again after a restore)" if again else "")


def _snapshot_table(record: RunRecord) -> str:
    if not record.snapshots:
        return ""
    t0 = record.t0
    ordered = sorted(record.snapshots, key=lambda s: (s.published, -s.ts))
    shown, more = _capped(ordered, "snapshot attempts")
    rows = [
        (
            f'<span id="row-{_e(s.snapshot_id)}">{_e(s.snapshot_id)}</span>',
            f"{s.cut_ts - t0:.1f}",
            f'<span class="{_e(s.outcome)}">{_e(s.outcome)}</span>',
            f"{s.pause_s * 1000:.1f}",
            f"{s.prepare_s * 1000:.1f}",
            f"{s.commit_s * 1000:.1f}",
            f"{s.write_s * 1000:.1f}",
            s.parked,
            s.restarts,
            _e(s.detail),
        )
        for s in shown
    ]
    headers = ["snapshot", "pause ended (s)", "outcome", "pause ms", "prepare ms", "commit ms"]
    headers += ["write ms", "saved", "restarts", "why it failed, or a note"]
    table = _table(headers, rows, numeric=frozenset({1, 3, 4, 5, 6, 7, 8}))
    return f"<h2>Snapshot attempts (failed first, then newest)</h2>{table}{more}"


def _restores(record: RunRecord) -> str:
    if not record.restores:
        return ""
    t0 = record.t0
    rows = []
    for r in record.restores:
        e = r.event
        redone = "not sampled" if r.calls_redone is None else f"&ge; {r.calls_redone}"
        journal = "&mdash;" if e.journal_turns is None else sum(e.journal_turns.values())
        rows.append(
            (
                f"{e.ts - t0:.1f}",
                _e(e.snapshot_id),
                e.train_step,
                e.continued,
                e.restarted,
                e.adopted,
                e.requeued,
                e.turns_kept,
                journal,
                redone,
            )
        )
    headers = ["at (s)", "snapshot", "train step", "continued", "restarted", "adopted"]
    headers += ["requeued", "policy calls kept", "turns from the journal", "policy calls re-done"]
    return (
        "<h2>Restores</h2>"
        + _table(headers, rows, numeric=frozenset({0, 2, 3, 4, 5, 6, 7, 8, 9}))
        + "<p class='sub'>Policy calls kept: turns the continued episodes had completed at the "
        "cut. Turns from the journal: turns the agents' journals held past the cut, which "
        "the episodes resume through instead of playing again (&mdash;: no agent journals). "
        "Re-done: calls the model servers answered between the cut and the restore "
        "(lost with the crash, unless a journal answers them again), from the trainer's "
        "samples of their counters; the turns restarted episodes had played before the cut "
        "come on top.</p>"
    )


def _journals(record: RunRecord) -> str:
    """Each participant's journal in the store, with the marks the kept snapshots hold
    for it and what the last restore took from it (docs/journal.md)."""
    journals: list[dict[str, Any]] = record.inspect.get("journals") or []
    if not journals:
        return ""
    last = next(
        (r.event for r in reversed(record.restores) if r.event.journal_turns is not None), None
    )
    rows = []
    for j in journals:
        name = f"{j['kind']}/{j['instance']}"
        position = j.get("last_position")
        durable = "none" if j.get("last_key") is None else f"{j['last_kind']} {j['last_key']}"
        if position is not None:
            durable += f" (segment {position[0]}, offset {position[1]})"
        marks = "; ".join(
            f"{m['snapshot']}: segment {m['segment']}, offset {m['offset']}"
            for m in j.get("marks", [])
        )
        parts = []
        if last is not None and last.journal_turns is not None and name in last.journal_turns:
            replies = (last.journal_replies or {}).get(name, 0)
            parts.append(f"{last.journal_turns[name]} turns, {replies} finished replies")
        read = None if last is None else (last.journal_read_ms or {}).get(name)
        if read is not None:
            parts.append(f"read back in {read} ms")
        taken = "; ".join(parts) or "&mdash;"
        damage = j.get("damage")
        rows.append(
            (
                f'<span id="journal-{_e(name)}">{_e(name)}</span>',
                j.get("records", "?"),
                j.get("bytes", "?"),
                j.get("segments", "?"),
                _e(durable)
                + (f'<br><span class="failed">damaged: {_e(damage)}</span>' if damage else ""),
                _e(marks) or "none (no kept snapshot marks it)",
                taken,
            )
        )
    headers = ["journal", "records", "bytes", "segments", "last durable record"]
    headers += ["kept snapshots' marks", "at the last restore"]
    restored = "" if last is None else f" (the last restore: {_e(last.snapshot_id)})"
    return (
        "<h2>Journals</h2>"
        + _table(headers, rows, numeric=frozenset({1, 2, 3}))
        + "<p class='sub'>Kept snapshots' marks: where each snapshot's cut found the journal; "
        "a restore from it replays the records after its mark, and retention deletes the "
        f"segments before the oldest. At the last restore{restored}: the turns and "
        "finished replies an agent's journal held past the snapshot, resumed or adopted "
        "instead of played again, and how long each server took to read its journal back "
        "as it started.</p>"
    )


def _replicas(record: RunRecord) -> str:
    rows = []
    t0 = record.t0
    for e in record.replica_events:
        if isinstance(e, ReplicaDown):
            rows.append((f"{e.ts - t0:.1f}", _e(e.replica), "down", f"{e.held} tries held"))
        else:
            rows.append((f"{e.ts - t0:.1f}", _e(e.replica), "up", f"{e.restored} tries restored"))
    for p in record.preemptions:
        what = f"snapshot {p.snapshot_id}" if p.snapshot_id else "no snapshot"
        rows.append((f"{p.ts - t0:.1f}", "", f"preempted ({_e(p.signal)})", _e(what)))
    for f in record.faults:
        rows.append((f"{f.ts - t0:.1f}", "", f"fault injected: {_e(f.kind)}", _e(f.detail)))
    if not rows:
        return ""
    rows.sort(key=lambda r: float(r[0]))
    return "<h2>Replicas, preemptions and faults</h2>" + _table(
        ("at (s)", "replica", "what", "detail"), rows, numeric=frozenset({0})
    )


def _latest(record: RunRecord) -> str:
    report = record.inspect
    invalid = "".join(
        f'<p class="note">not usable: {_e(b["id"])}: {_e(b["reason"])}</p>'
        for b in report.get("invalid", [])
    )
    latest = report.get("latest")
    if latest is None:
        return f"<h2>Latest snapshot</h2>{invalid}<p>no published snapshot in the store.</p>"
    head = (
        f"<p><b>{_e(latest['id'])}</b> at train step {_e(latest['train_step'])}, policy "
        f"version {_e(latest['policy_version'])}, pause {latest['pause_seconds'] * 1000:.1f} ms, "
        f"the finished queue holds {_e(latest['tq_size'])} rollouts; {len(report['snapshots'])} snapshots kept.</p>"
    )
    episodes, more = _capped(latest["episodes"], "saved episodes")
    saved = _table(
        ("episode", "replica", "group", "row", "turns completed"),
        (
            (
                _e(f"{e['rollout_id']}#{e['attempt']}"),
                _e(e["replica"]),
                _e(e["group_id"]),
                e["row"],
                e["turns_completed"],
            )
            for e in episodes
        ),
        numeric=frozenset({3, 4}),
    )
    other_rows = [
        (_e(f"{r['rollout_id']}#{r['attempt']}"), _e(r["replica"]), "starts over")
        for r in latest["restarts"]
    ] + [
        (_e(f"{f['rollout_id']}#{f['attempt']}"), _e(f["replica"]), "finished; adopted on restore")
        for f in latest["finished"]
    ]
    other = ""
    if other_rows:
        shown, more_other = _capped(other_rows, "episodes")
        other = (
            "<h3>Restarts and finished replies held at the cut</h3>"
            + _table(("episode", "replica", "what"), shown)
            + more_other
        )
    parts = _table(
        ("kind", "name", "replica", "mode"),
        (
            (_e(p["kind"]), _e(p["name"]), _e(p["replica"]), _e(p["mode"]))
            for p in latest["participants"]
        ),
    )
    return (
        f"<h2>Latest snapshot</h2>{invalid}{head}"
        f"<h3>Saved episodes ({len(latest['episodes'])})</h3>{saved}{more}{other}"
        f"<h3>Participants</h3>{parts}"
    )


def _config(record: RunRecord) -> str:
    if record.config is None:
        return ""
    text = yaml.safe_dump(record.config, sort_keys=False)
    return f"<h2>Config of the latest run</h2><pre>{_e(text)}</pre>"
