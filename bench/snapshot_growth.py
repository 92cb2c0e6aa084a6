"""What a snapshot writes against what changed since the previous one, with and without tokens.

The same real job as ``snapshot_pause`` (servers as processes, 2 replicas, a trainer keeping
N rows in flight and taking snapshots over the control protocol), run twice at each size:
without token data, and with ``capture_tokens`` on and ~1k-token turns (the scripted engine
returns vLLM-shaped ids and logprobs for ``reasoning_tokens`` of stand-in reasoning before
every tool call, so every turn's completion is about a thousand tokens and the call ledger
stores its ids and logprobs).

For every published snapshot, before it is published (not timed), the store measures from the
files themselves, not from what the writers report:

- ``held``: the bytes of records the participants' states and the trainer's files kept as
  records (ledger, the finished queue) hold (every part they name);
- ``written``: bytes of records files that did not exist before this snapshot, plus every
  manifest and trainer file in the snapshot's own folder;
- ``changed``: bytes of record lines that are not byte-for-byte a line of the same
  participant's state (or the same trainer file) in the previous snapshot (each line is
  hashed). The unit of change is a record: an agent session's header or transcript part, a
  model call, a resources episode, a chunk of the ledger's tasks, groups or final tries, a
  live try, a finished queue group.

``written_vs_changed`` divides the records files written by the bytes changed (goal at most
2); ``total_written_vs_changed`` adds what the snapshot's own folder holds (the manifests,
``trainer.json``). Then ``write`` (after the barrier reopened: every
participant writes what it captured and confirms it, and the trainer writes its files; the
publication, inside which this item measures, comes after and is not reported) and the
pause, as ``snapshot_pause`` measures them; ``bytes_per_token`` divides the model servers' held bytes by the token ids
their calls store (completion ids, with a logprob each, and prompt suffixes); ``restore_read_s``
reads and verifies every participant state of the last snapshot as a restore's participants
do: each in a process of its own, all at once (processes started beforehand, as a restore's
servers are up before they read), timed from the first read's start to the last one's end,
while the job still runs; ``restore_read_serial_s`` is the same reads one after the other in
one process (what this item measured before 2026-12-06), ``restore_read_slowest_s`` the
slowest participant's own read.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import multiprocessing
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import orjson

from bench.latency import percentile
from bench.report import BenchResult
from bench.snapshot_pause import KINDS, Phase, StageClock, TimedStore, _stats, measure
from rollpoint.protocol.manifest import (
    ParticipantManifest,
    RecordsManifest,
    SnapshotManifest,
    load_participant_manifest,
    load_trainer_file_manifest,
)
from rollpoint.store.digest import BLOCK_BYTES
from rollpoint.store.participant_state import MANIFEST_NAME, read_participant_state
from rollpoint.store.record_packs import OBJECTS_DIR
from rollpoint.store.snapshot_store import Staging
from rollpoint.tuning.collector_pause import collector_paused

TOKENS_POLICY: dict[str, Any] = {"capture_tokens": True, "reasoning_tokens": 1000}
"""~1k-token turns: 1,000 stand-in reasoning tokens before every tool call, ids and logprobs
captured."""


class GrowthStore(TimedStore):
    """The timed store, measuring every snapshot's held, written and changed bytes."""

    def __init__(self, root: str, keep: int, clock: StageClock) -> None:
        super().__init__(root, keep, clock)
        self.growth: dict[str, dict[str, int]] = {}
        self._lines: dict[str, set[bytes]] = {}
        """Line digests of each participant instance's state in the previous snapshot."""
        self._objects_seen: set[str] = set()
        self.measuring_s: dict[str, float] = {}

    def publish(self, staging: Staging, manifest: SnapshotManifest) -> SnapshotManifest:
        t0 = time.perf_counter()
        self.growth[staging.snapshot_id] = self._measure(staging, manifest)
        # The measuring reads every line the snapshot holds inside the publish, after the
        # coordinator's write span ends (report.write_s): the publish figures are left out
        # (see main), and the write's are as the coordinator measured them.
        self.measuring_s[staging.snapshot_id] = time.perf_counter() - t0
        return super().publish(staging, manifest)

    def _measure(self, staging: Staging, manifest: SnapshotManifest) -> dict[str, int]:
        objects = Path(self.root) / OBJECTS_DIR
        present = {p.name for p in objects.iterdir()} if objects.is_dir() else set()
        new_objects = present - self._objects_seen
        self._objects_seen = present
        out: dict[str, int] = defaultdict(int)
        for name in new_objects:
            out["written"] += (objects / name).stat().st_size
        folder = Path(staging.path)
        out["written"] += sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        states: list[tuple[str, str, RecordsManifest, Path]] = []
        for entry in manifest.participants:
            path = folder / entry.manifest_path
            held = load_participant_manifest(orjson.loads(path.read_bytes()), str(path))
            states.append((entry.instance, entry.kind.value, held, path.parent))
        for name, file in manifest.files.items():
            if file.format == "records":
                path = folder / file.path
                trainer = load_trainer_file_manifest(orjson.loads(path.read_bytes()), str(path))
                states.append((f"trainer:{name}", "trainer", trainer, path.parent))
        for owner, kind, state, directory in states:
            out["held"] += state.bytes
            out[f"held_{kind}"] += state.bytes
            previous = self._lines.get(owner, set())
            digests: set[bytes] = set()
            for line in _lines(state, directory, objects):
                digest = hashlib.sha256(line).digest()
                digests.add(digest)
                if digest not in previous:
                    out["changed"] += len(line) + 1
                    out[f"changed_{kind}"] += len(line) + 1
            self._lines[owner] = digests
        for name in new_objects:
            out["written_records"] += (objects / name).stat().st_size
        out["own_folder"] = out["written"] - out["written_records"]
        return dict(out)


def _lines(state: RecordsManifest, directory: Path, objects: Path) -> Iterator[bytes]:
    """Every record line a participant state names, read from its parts."""
    for part in state.parts:
        path = (objects if part.shared else directory) / part.file
        with path.open("rb") as stream:
            stream.seek(part.offset)
            left, tail = part.length, b""
            while left > 0:
                block = stream.read(min(BLOCK_BYTES, left))
                if not block:
                    break
                left -= len(block)
                lines = (tail + block).split(b"\n")
                tail = lines.pop()
                yield from lines


class _Last:
    """What ``after`` measures on the last published snapshot."""

    store: GrowthStore | None = None
    restore_read_s = 0.0
    restore_read_serial_s = 0.0
    restore_read_slowest_s = 0.0
    tokens = 0
    model_bytes = 0


def _read_paused(
    directory: str, *, kind: str, instance: str, checkpoint_id: str, root: str
) -> tuple[ParticipantManifest, list[dict[str, Any]]]:
    """:func:`read_participant_state` with the collector paused, as the fence's restore reads."""
    with collector_paused():
        return read_participant_state(
            directory, kind=kind, instance=instance, checkpoint_id=checkpoint_id, root=root
        )


def _read_counted(
    directory: str, *, kind: str, instance: str, checkpoint_id: str, root: str
) -> tuple[float, float, float, int, int]:
    """One participant's read in a process of its own: ``(start, end, seconds, bytes,
    token ids)`` (the records stay in that process; ``start``/``end`` on the shared
    monotonic clock)."""
    start = time.monotonic()
    state, records = _read_paused(
        directory, kind=kind, instance=instance, checkpoint_id=checkpoint_id, root=root
    )
    end = time.monotonic()
    tokens = 0
    if kind == "model":
        for record in records:
            call = record.get("call", {}) if record["kind"] == "model_call" else {}
            if call.get("tokens"):
                tokens += call["tokens"]["completion_count"] + call["tokens"]["prompt_count"]
    return start, end, end - start, state.bytes, tokens


def _ready() -> None:
    """Run once in each reader process before the clock starts: its imports done."""


async def _after(store: GrowthStore, last: _Last) -> None:
    manifest = await asyncio.to_thread(store.latest)
    if manifest is None:
        return
    folder = Path(store.snapshot_dir(manifest.snapshot_id))
    reads = [
        (
            str((folder / entry.manifest_path).parent),
            {
                "kind": entry.kind.value,
                "instance": entry.instance,
                "checkpoint_id": manifest.checkpoint_id,
                "root": store.root,
            },
        )
        for entry in manifest.participants
    ]
    # As a restore: every participant reads its own state in its own process, at once.
    spawn = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(len(reads), mp_context=spawn) as pool:
        await asyncio.gather(*(loop.run_in_executor(pool, _ready) for _ in reads))
        t0 = time.monotonic()
        done = await asyncio.gather(
            *(
                loop.run_in_executor(pool, functools.partial(_read_counted, d, **kw))
                for d, kw in reads
            )
        )
    last.restore_read_s = max(end for _, end, _, _, _ in done) - t0
    last.restore_read_slowest_s = max(seconds for _, _, seconds, _, _ in done)
    for (_, kw), (_, _, _, size, tokens) in zip(reads, done, strict=True):
        if kw["kind"] == "model":
            last.model_bytes += size
            last.tokens += tokens
    t0 = time.perf_counter()
    for directory, kw in reads:
        await asyncio.to_thread(_read_paused, directory, **kw)
    last.restore_read_serial_s = time.perf_counter() - t0
    assert (folder / MANIFEST_NAME).exists()


def _figures(
    phase: Phase, store: GrowthStore, last: _Last, tag: str
) -> dict[str, float | int | str]:
    measured = [store.growth[c.snapshot_id] for c in phase.cuts if c.snapshot_id in store.growth]
    out: dict[str, float | int | str] = {}

    def p50(key: str) -> float:
        return percentile([float(g.get(key, 0)) for g in measured], 50)

    for key in ("held", "written", "written_records", "changed", "own_folder"):
        out[f"{tag}_{key}_mb_p50"] = p50(key) / 1e6
    for kind in (*KINDS, "trainer"):
        out[f"{tag}_held_{kind}_mb_p50"] = p50(f"held_{kind}") / 1e6
        out[f"{tag}_changed_{kind}_mb_p50"] = p50(f"changed_{kind}") / 1e6
    ratios = [g.get("written_records", 0) / g["changed"] for g in measured if g.get("changed")]
    totals = [g["written"] / g["changed"] for g in measured if g.get("changed")]
    out[f"{tag}_written_vs_changed_p50"] = percentile(ratios, 50)
    out[f"{tag}_written_vs_changed_max"] = max(ratios, default=float("nan"))
    out[f"{tag}_total_written_vs_changed_p50"] = percentile(totals, 50)
    out[f"{tag}_written_vs_held_p50"] = (
        p50("written") / p50("held") if p50("held") else float("nan")
    )
    for part in ("write", "pause"):
        values = [c.seconds[part] for c in phase.cuts]
        out[f"{tag}_{part}_p50_ms"] = percentile(values, 50) * 1e3
        out[f"{tag}_{part}_p99_ms"] = percentile(values, 99) * 1e3
    out[f"{tag}_in_flight_at_cut"] = round(percentile([c.in_flight for c in phase.cuts], 50))
    out[f"{tag}_turns_per_saved_session"] = percentile([c.turns for c in phase.cuts], 50)
    out[f"{tag}_snapshots"] = len(phase.cuts)
    out[f"{tag}_failed_snapshots"] = len(phase.failed)
    out[f"{tag}_restore_read_s"] = last.restore_read_s
    out[f"{tag}_restore_read_slowest_s"] = last.restore_read_slowest_s
    out[f"{tag}_restore_read_serial_s"] = last.restore_read_serial_s
    if last.tokens:
        out[f"{tag}_tokens_stored"] = last.tokens
        out[f"{tag}_model_bytes_per_token"] = last.model_bytes / last.tokens
    return out


SETTLE_S = 120.0
"""Run this long after every session opened (a snapshot every 5 s, not measured) before
measuring: sessions are then some turns in, as in a steady job, not at their first."""
GAP_S = 5.0
"""Between measured snapshots: a job checkpointing every 5 s."""


async def run(
    sessions: Sequence[int] = (10_000,),
    *,
    snapshots: int = 6,
    settle_s: float = SETTLE_S,
    gap_s: float = GAP_S,
    variants: Sequence[str] = ("plain", "tokens", "tokens_journal"),
) -> BenchResult:
    """``variants``: ``plain``, ``tokens`` (token data), ``tokens_journal`` (token data, the
    servers journaling and every snapshot pause-free: ``snapshot.mode: journal``),
    ``journal`` (no token data, journaling and pause-free)."""
    figures: dict[str, float | int | str] = {}
    for n in sessions:
        for label, policy, mode in (
            ("plain", None, None),
            ("tokens", TOKENS_POLICY, None),
            ("tokens_journal", TOKENS_POLICY, "journal"),
            ("journal", None, "journal"),
        ):
            if label not in variants:
                continue
            last = _Last()

            async def after(store: TimedStore, last: _Last = last) -> None:
                assert isinstance(store, GrowthStore)
                last.store = store
                await _after(store, last)

            phase = await measure(
                n,
                snapshots=snapshots,
                warm=n < 50_000,
                policy=policy,
                snapshot_mode=mode,
                store_class=GrowthStore,
                after=after,
                settle_s=settle_s,
                gap_s=gap_s,
            )
            cuts = phase.cuts[1:] if n >= 50_000 else phase.cuts  # the cold first apart
            phase.cuts = cuts
            assert last.store is not None
            figures |= _figures(phase, last.store, last, f"n{n}_{label}")
            parts = _stats(phase, f"n{n}_{label}")  # the pause's parts, as snapshot_pause
            figures |= {
                k: v
                for k, v in parts.items()
                if k not in figures and "_ms" in k and "_write_" not in k and "_publish_" not in k
            }
            measuring = [last.store.measuring_s.get(c.snapshot_id, 0.0) for c in phase.cuts]
            figures[f"n{n}_{label}_measuring_p50_ms"] = percentile(measuring, 50) * 1e3
    return BenchResult(
        key="snapshot_growth",
        title="bytes a snapshot writes vs bytes changed since the previous one, tokens off/on",
        figures=figures,
        params={
            "sessions": "/".join(str(n) for n in sessions),
            "snapshots_each": snapshots,
            "settle_s": settle_s,
            "gap_s": gap_s,
            "tokens": "capture_tokens, 1,000 reasoning tokens a tool call (vLLM shape)",
            "unit_of_change": "a record (session, model call, resources episode)",
        },
    )
