"""Run the benchmark suite: ``python -m bench.run [--quick] [--only KEY ...] [--json]``."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import traceback
from collections.abc import Awaitable, Callable

import orjson

from bench import (
    checkpoint_overhead,
    control_latency,
    crash_rework,
    episode_throughput,
    generation_cut,
    journal_append,
    journal_job,
    ledger_scaling,
    long_episodes,
    model_overhead,
    runtime_compare,
    snapshot_cost,
    snapshot_growth,
    snapshot_io,
    snapshot_pause,
    soak,
)
from bench.report import BenchResult, print_results, save_results

Item = Callable[[bool], Awaitable[BenchResult]]


async def _sync(fn: Callable[..., BenchResult], *args: object) -> BenchResult:
    """A blocking item, run off the event loop."""
    return await asyncio.to_thread(fn, *args)


ITEMS: dict[str, Item] = {
    "model_overhead": lambda quick: model_overhead.run(calls=1500 if quick else 5000),
    "episode_throughput": lambda quick: episode_throughput.run(tasks=32 if quick else 128),
    "crash_rework": lambda quick: crash_rework.run(tasks=8 if quick else 24),
    "snapshot_io": lambda quick: _sync(
        snapshot_io.run, (10_000, 50_000) if quick else (10_000, 100_000)
    ),
    "checkpoint_overhead": lambda quick: (
        checkpoint_overhead.run(every_s=1.0, tasks=64, latency_ms=50, order=("off", "on"))
        if quick
        else checkpoint_overhead.run(every_s=5.0, tasks=768, latency_ms=100)
    ),
    "snapshot_pause": lambda quick: (
        snapshot_pause.run((100, 1000), snapshots=3)
        if quick
        else snapshot_pause.run((100, 1000, 10_000), snapshots=6)
    ),
    "ledger_scaling": lambda quick: (
        ledger_scaling.run((10_000, 100_000), queued=50_000)
        if quick
        else ledger_scaling.run((10_000, 100_000, 1_000_000))
    ),
    "runtime_compare": lambda quick: runtime_compare.run(),
    "snapshot_pause_100k": lambda quick: snapshot_pause.run_large(100_000, snapshots=4),
    "generation_cut": lambda quick: generation_cut.run(),
    "journal_append": lambda quick: journal_append.run(quick=quick),
    "journal_job": lambda quick: (
        journal_job.run(1000, settle_s=10, window_s=20, order=("off", "on"))
        if quick
        else journal_job.run()
    ),
    # Snapshots every 5 s against none, journal mode (issue 37); --quick at 1k, one leg a side.
    "snapshot_cost": lambda quick: (
        snapshot_cost.run(1000, settle_s=10, window_s=20, order=("off", "every_5s"))
        if quick
        else snapshot_cost.run()
    ),
    # The same at 100k without token data, one leg a side (two 100k ramps: ~15 minutes).
    "snapshot_cost_100k": lambda quick: snapshot_cost.run(
        100_000, order=("off", "every_5s"), tokens=False
    ),
    "control_latency": lambda quick: (
        control_latency.run(seconds=15, concurrency=32) if quick else control_latency.run()
    ),
    "long_episodes": lambda quick: (
        long_episodes.run(tasks=2, group_size=2) if quick else long_episodes.run()
    ),
    "snapshot_growth": lambda quick: (
        snapshot_growth.run((1000,), snapshots=3, settle_s=10.0, gap_s=2.0)
        if quick
        else snapshot_growth.run((10_000,), snapshots=6)
    ),
    # Without token data only: with ~1k-token turns the servers hold 7.4 GB at 10k in
    # flight (docs/log/performance-2026.md, session 13), and 100k would need far more than 24 GiB.
    # The cut, then pause-free snapshots (journal mode, issue 37).
    "snapshot_growth_100k": lambda quick: snapshot_growth.run(
        (100_000,), snapshots=4, settle_s=60.0, variants=("plain", "journal")
    ),
    # 21 minutes (--quick: 3; ROLLPOINT_SOAK_SECONDS sets it): by name only, with --only.
    "soak": lambda quick: soak.run(soak.duration(quick)),
}
# Items too slow for --quick: they run in the full suite, or by name with --only.
FULL_ONLY = {
    "runtime_compare",
    "snapshot_pause_100k",
    "generation_cut",
    "journal_job",
    "snapshot_cost",
    "snapshot_cost_100k",
    "snapshot_growth_100k",
    "soak",
}


async def _main(keys: list[str], quick: bool) -> list[BenchResult]:
    results = []
    for key in keys:
        print(f"running {key}…", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            result = await ITEMS[key](quick)
        except Exception as exc:  # one broken item must not lose the others' figures
            traceback.print_exc(file=sys.stderr)
            result = BenchResult(key, "FAILED", {"error": f"{type(exc).__name__}: {exc}"})
        result.elapsed_s = time.monotonic() - t0
        # Saved under the name it ran as: snapshot_growth_100k is snapshot_growth's code,
        # and its figures must not replace the 10k run's in latest.json.
        result.key = key
        print(f"  {key}: {result.elapsed_s:.1f} s", file=sys.stderr, flush=True)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run")
    parser.add_argument(
        "--quick", action="store_true", help="the subset that finishes in ~2 minutes"
    )
    parser.add_argument("--only", nargs="*", choices=sorted(ITEMS), help="run only these items")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    keys = args.only or [k for k in ITEMS if not (args.quick and k in FULL_ONLY)]
    results = asyncio.run(_main(keys, args.quick))
    # A partial run updates its items in the saved results and keeps the others.
    path = save_results(results, quick=args.quick, merge=bool(args.only))
    if args.json:
        print(
            orjson.dumps(
                {r.key: {"figures": r.figures, "params": r.params} for r in results}
            ).decode()
        )
    else:
        print_results(results)
        print(f"saved {path}", file=sys.stderr)
    failed = [r.key for r in results if "error" in r.figures]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
