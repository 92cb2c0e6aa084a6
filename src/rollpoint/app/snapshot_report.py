"""What ``rollpoint inspect`` shows: a run's snapshots and the contents of the latest.

Read-only: it opens the store without cleaning leftovers (a live run may be writing a
snapshot right now) and never changes a file. :func:`build_report` needs no extra (the
``report`` page reads it too); :func:`render_report` draws with rich (the ``cli`` extra).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollpoint.protocol.errors import ConfigError, RollpointError
from rollpoint.protocol.manifest import (
    SnapshotManifest,
    decode_document,
    load_participant_manifest,
)
from rollpoint.store.filesystem import LocalFilesystem
from rollpoint.store.journal_retention import JOURNAL_DIR
from rollpoint.store.journal_scan import summarize
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.dispatch.failed_groups import superseded
from rollpoint.trainer.restore.resume_point import read_trainer_document
from rollpoint.trainer.snapshot.publication import FINISHED_QUEUE_FILE, LEDGER_FILE
from rollpoint.trainer.state.ledger import RecoveryLedger

if TYPE_CHECKING:
    from rich.console import Console


def build_report(root: str, *, workdir: Path | None = None) -> dict[str, Any]:
    if workdir is not None and not workdir.exists():
        raise ConfigError(f"workdir {workdir} does not exist")
    if "://" not in root and not Path(root).exists():
        return {"snapshots": [], "invalid": [], "latest": None, "journals": []}
    store = SnapshotStore(root, clean_leftovers=False)
    summaries = store.list_snapshots(include_invalid=True)
    snapshots = []
    invalid = []
    marks: dict[str, list[dict[str, Any]]] = {}
    for summary in summaries:
        if not summary.valid:
            invalid.append({"id": summary.snapshot_id, "reason": summary.reason})
            continue
        manifest = store.load(summary.snapshot_id)
        for folder, mark in journal_marks(store, manifest).items():
            marks.setdefault(folder, []).append({"snapshot": manifest.snapshot_id, **mark})
        snapshots.append(
            {
                "id": manifest.snapshot_id,
                "published_at": manifest.published_at,
                "train_step": manifest.train_step,
                "pause_seconds": manifest.pause_seconds,
                "episodes": len(manifest.episodes),
                "restarts": len(manifest.restarts),
                "journaled": len(manifest.journaled),
            }
        )
    latest_manifest = store.latest()
    latest: dict[str, Any] | None = None
    if latest_manifest is not None:
        finished_queue_doc = read_trainer_document(
            store, latest_manifest.snapshot_id, FINISHED_QUEUE_FILE
        )
        tq_size = sum(len(b["replies"]) for b in finished_queue_doc.get("ready", [])) + len(
            finished_queue_doc.get("partial", [])
        )
        tq_size += sum(len(b["replies"]) for b in finished_queue_doc.get("consumed", []))
        latest = {
            "id": latest_manifest.snapshot_id,
            "train_step": latest_manifest.train_step,
            "policy_version": latest_manifest.policy_version,
            "pause_seconds": latest_manifest.pause_seconds,
            "episodes": [
                {
                    "rollout_id": e.rollout_id,
                    "attempt": e.attempt,
                    "replica": e.replica,
                    "group_id": e.group_id,
                    "row": e.row,
                    "turns_completed": e.turns_completed,
                }
                for e in latest_manifest.episodes
            ],
            "restarts": [r.model_dump(mode="json") for r in latest_manifest.restarts],
            "finished": [f.model_dump(mode="json") for f in latest_manifest.finished],
            "journaled": [j.model_dump(mode="json") for j in latest_manifest.journaled],
            "participants": [p.model_dump(mode="json") for p in latest_manifest.participants],
            "tq_size": tq_size,
            "failed_groups": failed_groups_at(store, latest_manifest.snapshot_id),
        }
    return {
        "snapshots": snapshots,
        "invalid": invalid,
        "damaged_files": damaged_files(invalid),
        "latest": latest,
        "journals": journals(root, marks),
    }


def journal_marks(store: SnapshotStore, manifest: SnapshotManifest) -> dict[str, dict[str, int]]:
    """Journal folder → where the snapshot's cut found it (``segment``, ``offset``: a
    restore from it replays the records after), from its participant manifests; a
    participant that did not journal has no mark. Local stores only, like :func:`journals`."""
    found: dict[str, dict[str, int]] = {}
    if "://" in store.root:
        return found
    folder = Path(store.snapshot_dir(manifest.snapshot_id))
    for entry in manifest.participants:
        relative = Path(entry.manifest_path)
        if relative.is_absolute() or ".." in relative.parts:
            continue  # the store refuses it on load; the report only reads what it may
        path = folder / relative
        try:
            participant = load_participant_manifest(
                decode_document(path.read_bytes(), str(path)), str(path)
            )
        except (OSError, RollpointError):
            continue  # the snapshot's own check reports it
        mark = participant.journal
        if mark is not None:
            found[mark.folder] = {"segment": mark.segment, "offset": mark.offset}
    return found


def journals(
    root: str, marks: dict[str, list[dict[str, Any]]] | None = None
) -> list[dict[str, Any]]:
    """Each participant's journal in the store (``journal/<kind>/<instance>``): records,
    bytes, segments, the last durable record and any damage, and the mark each kept
    snapshot holds for it (``marks``: journal folder → marks); read only."""
    base = Path(root) / JOURNAL_DIR
    if "://" in root or not base.is_dir():
        return []
    fs = LocalFilesystem()
    out = []
    for kind in sorted(p for p in base.iterdir() if p.is_dir()):
        for folder in sorted(p for p in kind.iterdir() if p.is_dir()):
            try:
                summary = summarize(fs, str(folder)).as_json()
            except OSError as exc:
                summary = {"damage": f"unreadable: {exc}"}
            relative = f"{JOURNAL_DIR}/{kind.name}/{folder.name}"
            kept = (marks or {}).get(relative, [])
            out.append({"kind": kind.name, "instance": folder.name, **summary, "marks": kept})
    return out


_RECORDS_FILE = re.compile(r"records file (\S+?)(?::| is | named | does | holds |$)")


def damaged_files(invalid: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Each records file an unusable snapshot's reason names → the snapshots it takes
    down (a shared file is named by several: issue 33)."""
    down: dict[str, list[str]] = {}
    for bad in invalid:
        found = _RECORDS_FILE.search(bad["reason"] or "")
        if found is not None:
            down.setdefault(found.group(1), []).append(bad["id"])
    return down


def failed_groups_at(store: SnapshotStore, snapshot_id: str) -> list[dict[str, str]]:
    """The groups the snapshot's ledger holds as failed and not sent again since
    (``rollpoint run --retry-failed``), each with its task and why it failed."""
    doc = read_trainer_document(store, snapshot_id, LEDGER_FILE)
    ledger = RecoveryLedger.from_document(doc, what=f"ledger of snapshot {snapshot_id}")
    retried = superseded(ledger)
    return [
        {"group_id": gid, "task_id": ledger.group(gid).task_id, "reason": reason}
        for gid, reason in ledger.failed_groups().items()
        if gid not in retried
    ]


def render_report(report: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    from rollpoint.app.full_table import print_full

    table = Table(title="snapshots (newest first)")
    for col in ("id", "published", "train step", "pause", "saved", "restarts"):
        table.add_column(col)
    import datetime as dt

    for s in report["snapshots"]:
        when = dt.datetime.fromtimestamp(s["published_at"], tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            s["id"],
            when,
            str(s["train_step"]),
            f"{s['pause_seconds'] * 1000:.1f} ms",
            str(s["episodes"]),
            str(s["restarts"]),
        )
    print_full(console, table)
    for bad in report["invalid"]:
        console.print(f"[yellow]not usable[/]: {bad['id']}: {bad['reason']}", soft_wrap=True)
    for path, ids in report.get("damaged_files", {}).items():
        console.print(
            f"[yellow]damaged records file[/] {path} takes down {len(ids)} snapshot(s): "
            + ", ".join(ids),
            soft_wrap=True,
        )
    _render_journals(report.get("journals") or [], console)
    latest = report["latest"]
    if latest is None:
        console.print("no usable snapshot")
        return
    console.print(
        f"latest: [bold]{latest['id']}[/] at train step {latest['train_step']}, "
        f"pause {latest['pause_seconds'] * 1000:.1f} ms, the finished queue holds {latest['tq_size']} rollouts",
        soft_wrap=True,
    )
    episodes = Table(title=f"saved episodes ({len(latest['episodes'])})")
    for col in ("episode", "replica", "group", "row", "turns completed"):
        episodes.add_column(col)
    for e in latest["episodes"]:
        episodes.add_row(
            f"{e['rollout_id']}#{e['attempt']}",
            e["replica"],
            e["group_id"],
            str(e["row"]),
            str(e["turns_completed"]),
        )
    print_full(console, episodes)
    failed = latest.get("failed_groups") or []
    if failed:
        groups = Table(
            title=f"failed groups ({len(failed)}; `rollpoint run --retry-failed` sends them again)"
        )
        for col in ("group", "task", "why"):
            groups.add_column(col)
        for f in failed:
            groups.add_row(f["group_id"], f["task_id"], f["reason"])
        print_full(console, groups)
    journaled = latest.get("journaled") or []
    if journaled:
        console.print(
            f"a journal-mode snapshot: {len(journaled)} tries in flight, each sent again on "
            "restore and continued from its replica's journals",
            soft_wrap=True,
        )
    if latest["restarts"] or latest["finished"]:
        other = Table(title="restarts and finished replies held at the cut")
        for col in ("episode", "replica", "what"):
            other.add_column(col)
        for r in latest["restarts"]:
            other.add_row(f"{r['rollout_id']}#{r['attempt']}", r["replica"], "starts over")
        for f in latest["finished"]:
            other.add_row(
                f"{f['rollout_id']}#{f['attempt']}", f["replica"], "finished; adopted on restore"
            )
        print_full(console, other)
    parts = Table(title="participants")
    for col in ("kind", "name", "replica", "mode"):
        parts.add_column(col)
    for p in latest["participants"]:
        parts.add_row(p["kind"], p["name"], p["replica"], p["mode"])
    print_full(console, parts)


def _render_journals(journals: list[dict[str, Any]], console: Console) -> None:
    if not journals:
        return
    from rich.table import Table

    from rollpoint.app.full_table import print_full

    table = Table(title="journals (docs/journal.md)")
    for col in ("participant", "records", "bytes", "segments", "last durable record"):
        table.add_column(col)
    for j in journals:
        position = j.get("last_position")
        last = "none" if j.get("last_key") is None else f"{j['last_kind']} {j['last_key']}"
        if position is not None:
            last += f" (segment {position[0]}, offset {position[1]})"
        if j.get("damage"):
            last += f"; damaged: {j['damage']}"
        table.add_row(
            f"{j['kind']}/{j['instance']}",
            str(j.get("records", "?")),
            str(j.get("bytes", "?")),
            str(j.get("segments", "?")),
            last,
        )
    print_full(console, table)
