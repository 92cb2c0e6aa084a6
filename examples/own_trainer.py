"""A trainer loop of its own on servers `rollpoint serve` started, through the façade only.

    rollpoint serve examples/workplace.yaml --json > served.json      # in one shell
    python examples/own_trainer.py served.json runs/own-trainer       # in another

The "policy update" is a stand-in (a running mean of advantages per task, saved as the
weights); the shape is a real async RL loop's: pull a batch, update, save the weights, say
done (handing over where the weights are), snapshot every few seconds. SIGTERM takes one
final snapshot and exits 143; SIGKILL anywhere loses only what came after the last one.
Run it again: it loads the weights the resumed step's state names; nothing is trained twice.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from pydantic import JsonValue

import rollpoint
from rollpoint import Rollouts, RollpointError, RunConfig, StopRequest

SNAPSHOT_EVERY_S = 2.0


def weights_of(state: JsonValue) -> dict[str, float]:
    """The weights the resumed step's state names (none on a fresh start)."""
    where = state.get("weights") if isinstance(state, dict) else None
    return json.loads(Path(where).read_text()) if isinstance(where, str) else {}


def save_weights(workdir: Path, step: int, weights: dict[str, float]) -> Path:
    folder = workdir / "weights"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"step-{step}.json.tmp"
    tmp.write_text(json.dumps(weights))
    return tmp.replace(folder / f"step-{step}.json")  # whole or absent, whenever killed


async def snapshot_now_and_then(run: Rollouts) -> None:
    while True:
        await asyncio.sleep(SNAPSHOT_EVERY_S)
        report = await run.snapshot()
        print(f"snapshot {report.snapshot_id}: published={report.published}", flush=True)


def config_for(workdir: Path, replicas: int) -> RunConfig:
    workdir.mkdir(parents=True, exist_ok=True)
    return rollpoint.parse_config(
        {"workdir": str(workdir), "environment": "workplace", "tasks": 16, "group_size": 2,
         "replicas": replicas, "concurrency": 8, "train": {"batch_size": 4}}
    )  # fmt: skip


async def train(served_file: Path, workdir: Path) -> None:
    served = rollpoint.load_served(served_file)
    config = config_for(workdir, len(served.replicas))
    stop = StopRequest.on_signals()  # SIGTERM, SIGINT: a final snapshot, then the end
    async with Rollouts(config, deployment=served, stop=stop) as run:
        if run.resumed_from:
            state = run.resumed_state
            where = state.get("weights") if isinstance(state, dict) else None
            print(
                f"resumed from {run.resumed_from} at step {run.resumed_step}: "
                f"{run.continued} episodes continued; weights {where}",
                flush=True,
            )
        weights = weights_of(run.resumed_state)
        snapshots = asyncio.create_task(snapshot_now_and_then(run))
        try:
            async for batch in run.batches():
                for sample in batch.samples:  # the stand-in update
                    old = weights.get(sample.task_id, 0.0)
                    weights[sample.task_id] = old + 0.5 * (sample.advantage - old)
                saved = save_weights(workdir, batch.step, weights)
                batch.done({"samples": float(len(batch.samples))}, state={"weights": str(saved)})
                print(f"step {batch.step}: {len(batch.samples)} samples", flush=True)
        finally:
            snapshots.cancel()
        summary = await run.summary()
    print(f"done: {summary.train_steps} steps, {summary.episodes} episodes", flush=True)


if __name__ == "__main__":
    try:
        asyncio.run(train(Path(sys.argv[1]), Path(sys.argv[2])))
    except rollpoint.RunPreemptedError as exc:  # SIGTERM: the final snapshot holds the run
        print(exc.message, flush=True)
        sys.exit(exc.exit_code)
    except asyncio.CancelledError:  # a second signal: no final snapshot
        sys.exit("stopped at once: the latest snapshot holds the run")
    except RollpointError as exc:  # a refused resume, a busy workdir, a bad config: one line
        sys.exit(f"error: {exc.message}")
