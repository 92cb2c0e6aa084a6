"""Run the benchmark suite: ``python -m bench.run [--quick] [--only KEY ...] [--json]``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable

import orjson

from bench import (
    checkpoint_overhead,
    crash_rework,
    episode_throughput,
    ledger_scaling,
    model_overhead,
    snapshot_io,
    snapshot_pause,
)
from bench.report import BenchResult, print_results, save_results

Item = Callable[[bool], Awaitable[BenchResult]]


async def _sync(fn: Callable[..., BenchResult], *args: object) -> BenchResult:
    """A blocking item, run off the event loop."""
    return await asyncio.to_thread(fn, *args)


ITEMS: dict[str, Item] = {
    "model_overhead": lambda quick: model_overhead.run(calls=1500 if quick else 5000),
    "episode_throughput": lambda quick: episode_throughput.run(tasks=32 if quick else 128),
    "crash_rework": lambda quick: crash_rework.run(tasks=24 if quick else 64),
    "snapshot_io": lambda quick: _sync(snapshot_io.run, (10_000,) if quick else (10_000, 100_000)),
    "checkpoint_overhead": lambda quick: (
        checkpoint_overhead.run(every_s=1.0, tasks=64, latency_ms=50)
        if quick
        else checkpoint_overhead.run(every_s=5.0, tasks=256, latency_ms=100)
    ),
    "snapshot_pause": lambda quick: (
        snapshot_pause.run((100, 1000), snapshots=3)
        if quick
        else snapshot_pause.run((100, 1000, 10_000), snapshots=6)
    ),
    "ledger_scaling": lambda quick: ledger_scaling.run(
        (10_000, 100_000) if quick else (10_000, 100_000, 1_000_000)
    ),
}


async def _main(keys: list[str], quick: bool) -> list[BenchResult]:
    results = []
    for key in keys:
        print(f"running {key}…", file=sys.stderr, flush=True)
        results.append(await ITEMS[key](quick))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run")
    parser.add_argument(
        "--quick", action="store_true", help="the subset that finishes in ~2 minutes"
    )
    parser.add_argument("--only", nargs="*", choices=sorted(ITEMS), help="run only these items")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    keys = args.only or list(ITEMS)
    results = asyncio.run(_main(keys, args.quick))
    path = save_results(results)
    if args.json:
        print(orjson.dumps({r.key: r.figures for r in results}).decode())
    else:
        print_results(results)
        print(f"saved {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
