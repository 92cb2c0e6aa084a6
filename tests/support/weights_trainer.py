"""A trainer on the façade that reports its own policy versions: before each step's
``done`` it pushes new weights (the scripted engine's ``update_weight_version``) inside
``weight_update`` in ``keep`` mode, the first time while a generation is mid-way, and keeps
its version in ``state``; resumed, it pushes the resumed step's weights again and says so.

``python weights_trainer.py run CONFIG ENGINE_URL`` (``run`` so that
:class:`tests.support.run_process.RunProcess` can start it as it starts the CLI); it says
``live <v>`` on stderr after each update. Used by ``tests/chaos/test_weight_update_crash.py``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx

from rollpoint import Rollouts, load_config


async def push(http: httpx.AsyncClient, version: int) -> None:
    reply = await http.post("/update_weight_version", json={"new_version": str(version)})
    reply.raise_for_status()


async def mid_generation(http: httpx.AsyncClient) -> None:
    """Return once a generation in flight has sampled some tokens (polling the engine)."""
    for _ in range(10_000):
        state = (await http.get("/weights_state")).json()
        if any(g["sampled"] >= 3 for g in state["generations"]):
            return
        await asyncio.sleep(0.002)
    raise AssertionError("no generation was ever mid-way")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def main(config_path: Path, engine_url: str) -> None:
    config = load_config(config_path)
    async with httpx.AsyncClient(base_url=engine_url, timeout=30) as http, Rollouts(config) as run:
        state = run.resumed_state if isinstance(run.resumed_state, dict) else {}
        version = int(str(state.get("version", 0)))
        if run.resumed_from is not None:
            # The engine may hold newer weights than the resumed step's: push those again.
            async with run.weight_update(version, mode="wait"):
                await push(http, version)
            say(f"resumed at step {run.resumed_step}; {run.continued} continued; live {version}")
        async for batch in run.batches():
            version += 1
            if batch.step == 1:
                await mid_generation(http)
            async with run.weight_update(version, mode="keep"):
                await push(http, version)
            say(f"live {version}")
            batch.done({}, state={"version": version})
        await run.summary()


if __name__ == "__main__":
    assert sys.argv[1] == "run"
    asyncio.run(main(Path(sys.argv[2]), sys.argv[3]))
