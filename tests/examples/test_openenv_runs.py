"""examples/openenv.yaml as its user would run it: the echo environment ``openenv init`` makes
from the template the ``openenv`` package ships (tests/support/openenv_echo.py), served by each
resources server in a child process, SIGKILLed mid-episode with everything else (the whole
process group: the OpenEnv servers and their sessions die too), rerun to the end, and checked
from the environment's own state.

Each resources server logs the exported state of every episode it verifies
(``final_states_log``), which holds what the OpenEnv server itself said: each step's reply
with the environment's own step number (``metadata.step``), and its ``state`` read at verify
(``step_count``, ``episode_id``). Held to:

- every row trained exactly once (I1, from ``train_data.jsonl``);
- nothing happened twice, nothing was lost: the server's ``step_count`` at the end is the
  number of successful ``openenv_step`` calls of the trained transcript, its ``episode_id``
  the episode's, the actions it took are those calls in order, and the step numbers the
  server gave them are 1, 2, … as the transcript's results show;
- every continued episode continued at its turn: its session had been rebuilt by replaying
  the actions taken before the kill (``replayed`` > 0) with no divergence (the echo
  environment is deterministic); a divergence would show in the transcript as the
  adapter's notice (a reported restart).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.envs import get_environment
from rollpoint.envs.openenv_env import STEP_TOOL
from tests.support.crash_rerun import (
    crash_and_rerun,
    final_state_of,
    final_states,
    held_at_the_restore,
    tool_calls,
    trained_once,
    write_example_config,
)
from tests.support.openenv_echo import REFERENCE, make_echo_env

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).parents[2] / "examples" / "openenv.yaml"
TASKS, GROUP_SIZE, TOOL_TURNS = 12, 2, 4


def write_config(tmp_path: Path) -> Path:
    return write_example_config(
        tmp_path,
        EXAMPLE,
        tasks=TASKS,
        group_size=GROUP_SIZE,
        # 120 ms a policy call: an episode (five calls) lives across 0.3 s snapshots.
        policy={"latency_ms": 120, "tool_turns": TOOL_TURNS},
        snapshot={"every_seconds": 0.3},
        train={"batch_size": 4},
    )


def steps_called(messages: list[dict[str, Any]]) -> list[tuple[Any, dict[str, Any]]]:
    """Each successful openenv_step call of a transcript: its arguments and its reply."""
    return [
        (call.arguments, orjson.loads(call.result))
        for call in tool_calls(messages)
        if call.name == STEP_TOOL and not call.failed
    ]


def test_sigkill_mid_episode_then_rerun_replays_every_episode_to_its_turn_and_steps_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property: Any
) -> None:
    make_echo_env(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # where `openenv init` put echo_env
    config = write_config(tmp_path)
    crash_and_rerun(
        config,
        tmp_path / "run",
        # Two actions taken and more to come: the rerun replays them and goes on.
        depth=2,
        most=TOOL_TURNS,
        # Each resources server imports OpenEnv (gradio with it) and boots its server first.
        checkpoint_timeout_s=180,
        rerun_timeout_s=400,
    )
    tasks = get_environment(REFERENCE).make_tasks(TASKS, 0)  # starts no server
    rollouts = trained_once(tmp_path / "run", tasks, GROUP_SIZE)
    states = final_states(tmp_path / "final")
    replayed = divergences = continued = steps = 0
    for r in rollouts:
        state = final_state_of(states, r)
        called = steps_called(r.messages)
        notices = [reply["notice"] for _, reply in called if "notice" in reply]
        assert len(notices) == state["restarts"], f"{r.subject}: a restart went unreported"
        since = max((i for i, (_, reply) in enumerate(called) if "notice" in reply), default=0)
        kept = called[since:]
        server = state["server_state"]
        # The environment's own count: every step it took once, none lost.
        assert server == {"episode_id": state["episode_id"], "step_count": len(kept)}, (
            f"{r.subject}: the server says {server}, the transcript has {len(kept)} steps"
        )
        assert state["actions"] == [args for args, _ in kept], f"{r.subject}: other actions"
        server_steps = [obs["metadata"]["step"] for obs, _, _ in state["trace"]]
        shown = [reply["observation"]["metadata"]["step"] for _, reply in kept]
        assert server_steps == shown == list(range(1, len(kept) + 1)), (
            f"{r.subject}: the server numbered its steps {server_steps}, the transcript {shown}"
        )
        replayed += state["replayed"]
        divergences += state["restarts"]
        steps += len(kept)
        # Steps the restored session held must have been replayed (held_at_the_restore).
        if any(c.name == STEP_TOOL and not c.failed for c in held_at_the_restore(r)):
            continued += 1
            assert state["replayed"] > 0 or state["restarts"] > 0, (
                f"{r.subject}: continued, yet its session was not rebuilt by replay"
            )
    record_property("replayed_actions", replayed)
    record_property("divergences", divergences)
    print(
        f"openenv echo: {steps} steps, {continued} continued episodes,"
        f" {replayed} actions replayed, {divergences} divergences"
    )
    assert continued > 0, "no episode continued with actions from before the kill"
    assert replayed > 0
    assert divergences == 0, "a deterministic environment's replay diverged"
