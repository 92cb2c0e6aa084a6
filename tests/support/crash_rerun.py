"""A run SIGKILLed mid-episode and rerun to the end: what the examples' crash tests share.

Owns the steps every such test takes around its own checks: the example's config with the
run and its final-states log under the test's folder, starting ``rollpoint run``
(each start noted, so a run still alive when the test ends is killed), waiting for the
first train checkpoint and then for a snapshot after it that holds an episode some turns
in, the SIGKILL of the whole run (nothing may outlive it), rerunning until a run exits 0
(a failed rerun may not end in a traceback), and reading back what the reruns said, what
was trained (every row exactly once, I1) and the final states the resources servers
logged, and the tool calls of a transcript. It judges nothing else: each test checks its
environment's own state or log.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson
import yaml

from rollpoint.envs import TaskRow
from rollpoint.servers.resources.final_state_log import FinalState, read_final_states
from rollpoint.testing import invariants
from rollpoint.testing.invariants import TrainedRollout
from tests.support.run_dir import has_checkpoint, newest_holds_depth, published
from tests.support.run_process import Finished, RunProcess

MAX_RERUNS = 3
_CONTINUED = re.compile(r"(\d+)\s+episodes\s+continued")


def write_example_config(
    tmp_path: Path, example: Path, *, policy: Mapping[str, Any], **fields: Any
) -> Path:
    """``example`` (a config under ``examples/``, as its user runs it) with its run folder
    (``run``) and its final-states log (``final``) under ``tmp_path``, ``policy`` set over its
    policy section and ``fields`` over the rest; written to ``tmp_path/job.yaml``."""
    config: dict[str, Any] = yaml.safe_load(example.read_text())
    config.update(
        workdir=str(tmp_path / "run"),
        final_states_log=str(tmp_path / "final"),
        policy={**config["policy"], **policy},
        **fields,
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class CrashedRun:
    """The runs of one crash test, in the order they were started; leaving the ``with``
    block kills any of them still alive (a test that failed half-way leaves nothing)."""

    def __init__(self, config: Path, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.store = workdir / invariants.SNAPSHOT_STORE_DIR
        self.started: list[RunProcess] = []

    def __enter__(self) -> CrashedRun:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for run in self.started:
            if run.proc.poll() is None:
                run.kill()

    def start(self) -> RunProcess:
        """``rollpoint run`` on the config, started now."""
        self.started.append(RunProcess(self.config))
        return self.started[-1]

    def wait_for_depth(
        self, run: RunProcess, depth: int, *, most: int, checkpoint_timeout_s: float = 60
    ) -> set[str]:
        """Wait until a snapshot published after the run's first train checkpoint holds an
        episode ``depth`` turns in with at most ``most`` done (one with work left): the
        newest snapshot, which a rerun restores from.

        Waiting for the depth, not for any snapshot, is what makes the kill a crash test: on
        a loaded machine the first snapshot after the checkpoint may catch only episodes that
        had not completed a turn, and a continued episode then keeps nothing. Returns the
        snapshots published before the checkpoint."""
        run.wait_until(
            lambda: has_checkpoint(self.workdir),
            "a train checkpoint",
            timeout_s=checkpoint_timeout_s,
        )
        before = published(self.store)
        run.wait_until(
            lambda: newest_holds_depth(self.store, before, depth, most=most),
            f"a snapshot after it holding an episode {depth} turn(s) in",
        )
        return before

    def kill_at_depth(
        self, run: RunProcess, depth: int, *, most: int, checkpoint_timeout_s: float = 60
    ) -> None:
        """SIGKILL the run at a moment its newest snapshot holds an episode ``depth`` turns
        in with at most ``most`` done (:meth:`wait_for_depth`).

        Seeing that snapshot and killing the run are two moments: a snapshot published
        between them can hold only younger episodes (the one seen may have ended since), and
        the rerun restores the newest, so a test that needs an episode continued from its
        turn failed now and then on a loaded machine. So the run's whole process group is
        stopped first (SIGSTOP: nothing publishes while stopped) and the newest snapshot read
        again: the kill comes only if it still holds such an episode; otherwise the run
        goes on (SIGCONT) and the wait starts over."""
        before = self.wait_for_depth(
            run, depth, most=most, checkpoint_timeout_s=checkpoint_timeout_s
        )
        while True:
            os.killpg(run.proc.pid, signal.SIGSTOP)
            if newest_holds_depth(self.store, before, depth, most=most):
                self.kill(run)
                return
            os.killpg(run.proc.pid, signal.SIGCONT)
            run.wait_until(
                lambda: newest_holds_depth(self.store, before, depth, most=most),
                f"a snapshot holding an episode {depth} turn(s) in",
            )

    def kill(self, run: RunProcess) -> None:
        """SIGKILL the run (alive until now) and every process it started."""
        assert run.proc.poll() is None, f"the run ended before the kill:\n{run.stderr[-2000:]}"
        assert run.kill() == [], "processes outlived the killed run"

    def rerun_until_ok(self, *, timeout_s: float) -> list[Finished]:
        """Rerun until a run exits 0 (at most :data:`MAX_RERUNS`); every rerun, in order."""
        runs: list[Finished] = []
        while len(runs) < MAX_RERUNS:
            runs.append(self.start().finish(timeout_s=timeout_s))
            if runs[-1].returncode == 0:
                return runs
            assert "Traceback" not in runs[-1].stderr, runs[-1].stderr[-3000:]
        raise AssertionError("reruns failed:\n" + "\n---\n".join(r.stderr[-1500:] for r in runs))


def crash_and_rerun(
    config: Path,
    workdir: Path,
    *,
    depth: int,
    most: int,
    checkpoint_timeout_s: float = 60,
    rerun_timeout_s: float = 240,
) -> list[Finished]:
    """Start the run, SIGKILL it while the newest snapshot holds an episode ``depth`` turns
    in (:meth:`CrashedRun.kill_at_depth`), rerun it to the end; the reruns, of which the
    first continued some episodes (checked)."""
    with CrashedRun(config, workdir) as crash:
        run = crash.start()
        crash.kill_at_depth(run, depth, most=most, checkpoint_timeout_s=checkpoint_timeout_s)
        reruns = crash.rerun_until_ok(timeout_s=rerun_timeout_s)
    assert_episodes_continued(reruns[0])
    return reruns


def assert_episodes_continued(rerun: Finished) -> None:
    """The rerun's restore line says it continued some saved episodes."""
    match = _CONTINUED.search(rerun.stderr)
    assert match and int(match.group(1)) > 0, rerun.stderr[-2000:]


def trained_once(workdir: Path, tasks: Iterable[TaskRow], group_size: int) -> list[TrainedRollout]:
    """The rollouts the run trained (``train_data.jsonl``), every row of ``tasks`` exactly
    once (I1, checked)."""
    rollouts, unreadable = invariants.read_train_data(workdir)
    expected = invariants.expected_rows(tasks, group_size)
    found = [*unreadable, *invariants.check_exactly_once(rollouts, expected)]
    assert found == [], invariants.report(found)
    return rollouts


def final_states(folder: Path) -> dict[tuple[str, int], FinalState]:
    """The final state the resources servers logged for each (rollout id, attempt) they
    verified (``final_states_log``); every line readable (checked)."""
    states, problems = read_final_states(folder)
    assert problems == []
    return states


def final_state_of(states: Mapping[tuple[str, int], FinalState], rollout: TrainedRollout) -> Any:
    """The state logged when the trained try was verified (checked that there is one)."""
    entry = states.get((rollout.rollout_id, rollout.attempt))
    assert entry is not None, f"{rollout.subject}: no final state logged"
    return entry.state


def continued_from_before_the_kill(rollout: TrainedRollout) -> bool:
    """A continued try (attempt >= 1) that kept policy calls an earlier attempt made."""
    calls = rollout.model_calls
    return (
        rollout.attempt >= 1
        and calls is not None
        and any(c.attempt < rollout.attempt for c in calls)
    )


def held_at_the_restore(rollout: TrainedRollout) -> list[ToolCall]:
    """The tool calls a continued try's restored environment already held: those of every
    turn before the last turn an earlier attempt made. That turn's policy call was sent
    with their results, so the snapshot the rerun restored (a consistent cut) holds the
    environment with them applied. The last such turn's own calls may have run before the
    kill or after the restore (a reply the rerun adopted): not counted. Empty for a try
    that is not continued."""
    calls = rollout.model_calls
    if rollout.attempt < 1 or not calls:
        return []
    earlier = [c.turn for c in calls if c.attempt < rollout.attempt]
    if not earlier:
        return []
    turns = [m for m in rollout.messages if m["role"] == "assistant"]
    assert len(turns) >= max(earlier) + 1, f"{rollout.subject}: fewer replies than turns"
    held_ids = {
        call["id"] for message in turns[: max(earlier)] for call in message.get("tool_calls") or ()
    }
    return [c for c in tool_calls(rollout.messages) if c.call_id in held_ids]


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a transcript, with the result the transcript shows for it."""

    call_id: str
    name: str
    raw_arguments: str
    result: str

    @property
    def failed(self) -> bool:
        """The result is an error (the call did not happen)."""
        return self.result.startswith("error")

    @property
    def arguments(self) -> Any:
        """The arguments, parsed (a failed call's may not parse: the policy can send
        malformed ones, which the server refuses)."""
        return orjson.loads(self.raw_arguments or "{}")


def tool_calls(messages: list[dict[str, Any]]) -> list[ToolCall]:
    """Every tool call of a transcript, in order."""
    results = {m.get("tool_call_id"): m.get("content") for m in messages if m["role"] == "tool"}
    return [
        ToolCall(
            call_id=call["id"],
            name=call["function"]["name"],
            raw_arguments=call["function"]["arguments"],
            result=str(results.get(call["id"])),
        )
        for message in messages
        for call in message.get("tool_calls") or ()
    ]
