"""The report's plots, drawn with matplotlib and rendered to inline SVG.

Owns every figure of the page: the run's timeline (snapshots as marks, their pause and
outcome; train steps, restores, replica losses, preemptions, reruns), the pause histogram
with its p50 and p99, the pause against the sessions in flight at the cut, and the episodes
in flight per replica over time. Each function takes a :class:`RunRecord` and returns SVG
markup to put in the page as it is: text stays text (the browser's fonts, searchable), ids
are stable from one render to the next, and each snapshot's mark is a ``<g>`` whose id is
the snapshot id, with a ``<title>`` the browser shows on hover (its outcome, pause and, for
a failed one, why). Figures never touch pyplot or its global state: a report can be drawn
in any process, next to anything.
"""

from __future__ import annotations

import bisect
import html
import io
import itertools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from matplotlib.typing import RcKeyType

from rollpoint.app.report.run_record import RunRecord, SnapshotAttempt
from rollpoint.trainer.run_events import ReplicaDown

OUTCOME_COLOURS = {"published": "#2a9d55", "failed": "#d62728"}
MARK_COLOURS = {
    "train step": "#9a9a9a",
    "restore": "#1f5fbf",
    "replica down": "#e07b00",
    "replica up": "#6a9f2a",
    "preemption": "#8e44ad",
    "rerun": "#222222",
    "crash": "#d62728",
    "fault injected": "#b8860b",
}
MAX_MARKED_SNAPSHOTS = 400
"""Beyond this many snapshots the timeline draws them as one collection (no per-mark
hover: the table lists them), so a day-long run's page stays small."""

_SVG_RC: dict[RcKeyType, Any] = {
    "svg.fonttype": "none",  # text as text: the browser's fonts, and findable in the page
    "svg.hashsalt": "rollpoint-report",  # the same ids from one render to the next
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
}


@contextmanager
def _figure(height: float, width: float = 9.0) -> Iterator[tuple[Figure, Axes]]:
    with matplotlib.rc_context(_SVG_RC):
        fig = Figure(figsize=(width, height), layout="constrained")
        yield fig, fig.add_subplot()


def _svg(fig: Figure, titles: dict[str, str] | None = None) -> str:
    with matplotlib.rc_context(_SVG_RC):
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    for gid, title in (titles or {}).items():
        text = text.replace(
            f'<g id="{gid}">', f'<g id="{gid}"><title>{html.escape(title)}</title>', 1
        )
    # Fixed sizes in pt would overflow a narrow window: let the page scale it.
    return re.sub(r'(<svg[^>]*?) width="[^"]*" height="[^"]*"', r"\1", text, count=1)


def snapshot_title(s: SnapshotAttempt) -> str:
    title = f"{s.snapshot_id}: {s.outcome}, pause {s.pause_s * 1000:.1f} ms, {s.parked} saved"
    if s.restarts:
        title += f", {s.restarts} restarts"
    if s.detail:
        title += f"\n{s.detail}"
    return title


def _event_marks(ax: Axes, record: RunRecord, *, label: bool) -> None:
    """Vertical lines for what happened to the run, one colour per kind."""
    t0 = record.t0
    seen: set[str] = set()

    def vline(ts: float, kind: str, style: Any, text: str = "", side: str = "left") -> None:
        ax.axvline(
            ts - t0,
            color=MARK_COLOURS[kind],
            linestyle=style,
            linewidth=1.2,
            label=kind if label and kind not in seen else None,
        )
        seen.add(kind)
        if text and label:
            ax.annotate(
                text,
                (ts - t0, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha=side,
                fontsize=7,
                color=MARK_COLOURS[kind],
            )

    for i, (before, segment) in enumerate(itertools.pairwise(record.segments)):
        # A run stopped by a signal is drawn as its preemption (below), not as a crash.
        if before.end is None and record.stopped_by(i) is None:
            vline(before.last_ts, "crash", ":", "last sign of life", "right")
        vline(segment.start.ts, "rerun", "-", "rerun", "right")
    for r in record.restores:
        vline(r.event.ts, "restore", "--", f"restore {r.event.snapshot_id}")
    for e in record.replica_events:
        if isinstance(e, ReplicaDown):
            vline(e.ts, "replica down", "--", f"{e.replica} down")
        else:
            vline(e.ts, "replica up", ":", f"{e.replica} up")
    for p in record.preemptions:
        vline(p.ts, "preemption", "-.", f"preempted ({p.signal})")
    for f in record.faults:
        vline(f.ts, "fault injected", (0, (1, 3)), f.kind)


def timeline(record: RunRecord) -> str:
    """Snapshots over time (height: pause), with the run's events as vertical lines."""
    t0 = record.t0
    titles: dict[str, str] = {}
    with _figure(3.6) as (fig, ax):
        ax.set_title("timeline of the run")
        ax.set_xlabel("seconds since the run started")
        ax.set_ylabel("snapshot pause (ms)")
        marked = len(record.snapshots) <= MAX_MARKED_SNAPSHOTS
        for outcome, colour in OUTCOME_COLOURS.items():
            group = [s for s in record.snapshots if s.outcome == outcome]
            if not group:
                continue
            xs = [s.cut_ts - t0 for s in group]
            ys = [s.pause_s * 1000 for s in group]
            ax.vlines(xs, 0, ys, colors=colour, linewidth=0.8, alpha=0.5)
            ax.scatter(
                xs, ys, color=colour, s=18, zorder=3, label=f"snapshot {outcome} ({len(group)})"
            )
            if marked:
                # One invisible artist per snapshot carries its id and hover text.
                for s, x, y in zip(group, xs, ys, strict=True):
                    (mark,) = ax.plot([x], [y], "o", markersize=9, alpha=0.0)
                    mark.set_gid(s.snapshot_id)
                    titles[s.snapshot_id] = snapshot_title(s)
        if record.train_steps:
            ax.plot(
                [t.ts - t0 for t in record.train_steps],
                [0.0] * len(record.train_steps),
                "|",
                color=MARK_COLOURS["train step"],
                markersize=12,
                label=f"train step ({len(record.train_steps)})",
                clip_on=False,
            )
        _event_marks(ax, record, label=True)
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
        return _svg(fig, titles)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def pause_percentiles(record: RunRecord) -> tuple[float, float]:
    """p50 and p99 of every snapshot attempt's pause, in ms."""
    pauses = [s.pause_s * 1000 for s in record.snapshots]
    return _percentile(pauses, 50), _percentile(pauses, 99)


def pause_histogram(record: RunRecord) -> str:
    pauses = [s.pause_s * 1000 for s in record.snapshots]
    p50, p99 = pause_percentiles(record)
    with _figure(3.0, 4.4) as (fig, ax):
        ax.set_title(f"pause distribution ({len(pauses)} snapshots)")
        ax.set_xlabel("pause (ms)")
        ax.set_ylabel("snapshots")
        ax.hist(pauses, bins=min(30, max(5, len(pauses))), color="#4c78a8")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.axvline(p50, color="#222222", linestyle="--", label=f"p50 {p50:.1f} ms")
        ax.axvline(p99, color="#d62728", linestyle=":", label=f"p99 {p99:.1f} ms")
        ax.legend(fontsize=7)
        return _svg(fig)


def pause_against_sessions(record: RunRecord) -> str:
    with _figure(3.0, 4.4) as (fig, ax):
        ax.set_title("pause against sessions in flight")
        ax.set_xlabel("sessions in flight at the cut (saved + restarts)")
        ax.set_ylabel("pause (ms)")
        for outcome, colour in OUTCOME_COLOURS.items():
            group = [s for s in record.snapshots if s.outcome == outcome]
            if group:
                ax.scatter(
                    [s.in_flight for s in group],
                    [s.pause_s * 1000 for s in group],
                    color=colour,
                    s=14,
                    label=outcome,
                )
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        return _svg(fig)


def episodes_in_flight(record: RunRecord) -> str:
    """Episodes in flight per replica, from the trainer's samples."""
    t0 = record.t0
    with _figure(3.0) as (fig, ax):
        ax.set_title("episodes in flight per replica")
        ax.set_xlabel("seconds since the run started")
        ax.set_ylabel("episodes")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        starts = [segment.start.ts for segment in record.segments]
        colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, replica in enumerate(record.replicas):
            # One line per run of the job: nothing was in flight between a crash and its rerun.
            runs: dict[int, list[tuple[float, int]]] = {}
            for sample in record.samples:
                if replica in sample.episodes:
                    runs.setdefault(bisect.bisect_right(starts, sample.ts), []).append(
                        (sample.ts - t0, sample.episodes[replica])
                    )
            for n, points in enumerate(runs.values()):
                xs, ys = zip(*points, strict=True)
                ax.step(
                    xs,
                    ys,
                    where="post",
                    label=replica if n == 0 else None,
                    color=colours[i % len(colours)],
                    linewidth=1.2,
                )
        for snap in record.snapshots:
            ax.axvline(
                snap.cut_ts - t0, color=OUTCOME_COLOURS.get(snap.outcome, "#999"), alpha=0.15
            )
        _event_marks(ax, record, label=False)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        if record.replicas:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
        return _svg(fig)
