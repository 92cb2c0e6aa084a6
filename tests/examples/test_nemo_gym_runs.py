"""examples/nemo_gym.yaml as its user would run it, against a server speaking NeMo-Gym's
resources-server wire (the stand-in of NeMo-Gym's counter server, a real process that lives
through the kill as a NeMo-Gym server would: NeMo-Gym itself needs Python 3.12): SIGKILLed
mid-episode, rerun to the end, and checked from the server's own log.

The server logs every increment it applied, by session. Held to:

- every row trained exactly once (I1, from ``train_data.jsonl``);
- nothing happened twice, nothing was lost: some session of the server applied exactly the
  increments of the trained transcript's successful calls (since a reported restart), once
  each and in order, and every ``get_counter_value`` reply in the transcript is the row's
  ``initial_count`` plus the increments before it;
- every continued episode continued at its turn: its calls before the kill were replayed on
  a new session (``replayed`` > 0) with no divergence (the counter is deterministic).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.envs import get_environment
from tests.support.crash_rerun import (
    crash_and_rerun,
    final_state_of,
    final_states,
    held_at_the_restore,
    tool_calls,
    trained_once,
    write_example_config,
)
from tests.support.nemo_gym_stand_in import counter_server, server_log

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

EXAMPLE = Path(__file__).parents[2] / "examples" / "nemo_gym.yaml"
ROWS = Path(__file__).parents[2] / "examples" / "nemo_gym_counter_rows.jsonl"
TASKS, GROUP_SIZE, TOOL_TURNS = 10, 2, 4


def write_config(tmp_path: Path, url: str) -> tuple[Path, str]:
    environment = f"nemo-gym:{url}@{ROWS}"
    path = write_example_config(
        tmp_path,
        EXAMPLE,
        environment=environment,
        tasks=TASKS,
        group_size=GROUP_SIZE,
        max_turns=8,
        # 120 ms a policy call: an episode (five calls) lives across 0.3 s snapshots.
        policy={"latency_ms": 120, "tool_turns": TOOL_TURNS},
        snapshot={"every_seconds": 0.3},
        train={"batch_size": 4},
    )
    return path, environment


def calls_made(messages: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], str]]:
    """Each successful tool call of a transcript: its tool, arguments and reply."""
    return [(c.name, c.arguments, c.result) for c in tool_calls(messages) if not c.failed]


def test_sigkill_mid_episode_then_rerun_replays_every_episode_to_its_turn_and_calls_once(
    tmp_path: Path, record_property: Any
) -> None:
    with counter_server() as url:
        config, environment = write_config(tmp_path, url)
        crash_and_rerun(config, tmp_path / "run", depth=2, most=TOOL_TURNS)
        applied = server_log(url)["increments"]

    by_session: dict[str, list[int]] = {}
    for entry in applied:
        by_session.setdefault(entry["session"], []).append(entry["count"])
    tasks = get_environment(environment).make_tasks(TASKS, 0)
    rollouts = trained_once(tmp_path / "run", tasks, GROUP_SIZE)
    initial = {t.task_id: t.params["row"]["initial_count"] for t in tasks}  # type: ignore[index,call-overload]

    states = final_states(tmp_path / "final")
    replayed = divergences = continued = 0
    for r in rollouts:
        state = final_state_of(states, r)
        made = calls_made(r.messages)
        notices = [i for i, (_, _, reply) in enumerate(made) if "restarted" in reply]
        assert len(notices) == state["restarts"], f"{r.subject}: a restart went unreported"
        kept = made[max(notices, default=0) :]
        assert [(t, a) for t, a, _ in kept] == [(t, a) for t, a, _ in state["calls"]], (
            f"{r.subject}: the calls kept are not the transcript's"
        )
        increments = [a["count"] for t, a, _ in kept if t == "increment_counter"]
        if increments:
            # The server's own log: one session applied exactly these, once each, in order.
            assert increments in by_session.values(), (
                f"{r.subject}: no session of the server applied {increments}"
            )
        count = initial[r.task_id]
        for tool, args, reply in kept:
            if tool == "increment_counter":
                count += args["count"]
            elif tool == "get_counter_value":
                shown = orjson.loads(reply.split("\n\n")[0])["count"]
                assert shown == count, f"{r.subject}: the server counted {shown}, calls say {count}"
        replayed += state["replayed"]
        divergences += state["restarts"]
        # Calls the restored session held must have been replayed (held_at_the_restore).
        if any(not c.failed for c in held_at_the_restore(r)):
            continued += 1
            assert state["replayed"] > 0 or state["restarts"] > 0, (
                f"{r.subject}: continued, yet its session was not rebuilt by replay"
            )
    record_property("replayed_calls", replayed)
    print(f"nemo-gym counter: {continued} continued episodes, {replayed} calls replayed")
    assert continued > 0, "no episode continued with calls from before the kill"
    assert replayed > 0
    assert divergences == 0, "a deterministic server's replay diverged"
