"""What a run has left in its folders so far, read while it runs (crash tests' kill moments).

Owns reading a snapshot store's published snapshot ids and the newest one's manifest, and
whether a workdir holds a train checkpoint. It starts, kills and judges nothing.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from rollpoint.testing import invariants


def published(store: Path) -> set[str]:
    """The snapshots published in ``store`` (a snapshot store's root folder)."""
    return {p.parent.name for p in (store / "snapshots").glob("*/manifest.json")}


def has_checkpoint(workdir: Path) -> bool:
    return any((workdir / invariants.CHECKPOINTS_DIR).glob("step-*.json"))


def newest_holds_depth(store: Path, before: set[str], turns: int, most: int | None = None) -> bool:
    """The newest snapshot published since ``before`` holds an episode in flight that had
    completed at least ``turns`` turns (and at most ``most``): killed now, the rerun
    continues it from there (snapshot ids sort by their creation time)."""
    fresh = sorted(published(store) - before)
    if not fresh:
        return False
    manifest = orjson.loads((store / "snapshots" / fresh[-1] / "manifest.json").read_bytes())
    return any(
        turns <= e["turns_completed"] and (most is None or e["turns_completed"] <= most)
        for e in manifest["episodes"]
    )
