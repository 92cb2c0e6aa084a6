"""Durable turns across a SIGKILL (issue 35's done-when).

A job with journaling on and no periodic snapshot or train checkpoint during the test
(``snapshot.every_seconds: 600``, ``train.checkpoint_every_steps: 1000``: the only snapshot
is the one taken before the first row is sent) is SIGKILLed at a random moment (a seeded
share of its policy calls done), either trainer and servers together (then rerun: the
rerun resumes from that first snapshot and sends every unfinished row again under its
rollout id) or the replicas' servers alone (the trainer lives on; the runtime restarts
them and the trainer holds every try they ran for them). Each agent resumes every episode
at its last journaled turn, the resources servers rebuild its state from their journals,
and any call made again is answered from the journals. Counted from the outside:

- each agent's own journal: after the kill, no episode journals a turn before the last one
  it journaled before the kill (it was not played again from an earlier turn); with
  snapshots every 0.5 s, the restore line's count of turns past the snapshot in the
  journals, and retention having kept exactly what the kept snapshots' marks need;

- the scripted policy runs as its own process with its own call log (``policy.call_log``);
  with ``seed: turn`` each call's seed names its (rollout, turn), so a key logged before the
  kill and again after it is a policy call done twice: there are at most as many as calls
  were in flight at the kill (at most ``concurrency``, and each among the engine's last
  ``concurrency`` replies before it), where without the journal every call is done again;
- every turn trained carries the token ids and logprobs the engine logged for it;
- the environment's tools also write each effect to a log outside their state
  (``tests.support.effect_log_env``): each effect is there, a journaled one exactly once
  (one in flight at the kill may be there twice: the in-doubt window of issue 36);
- invariants I1 to I4 hold (every row trained once).
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.app.config import load_config
from rollpoint.app.snapshot_report import build_report
from rollpoint.job.tasks import load_tasks_for
from rollpoint.protocol.token_data import as_float32
from rollpoint.servers.agent.episode_runner import turn_seed
from rollpoint.store.journal_format import HEADER, Damage, scan_frames
from rollpoint.testing import invariants
from tests.chaos.test_crash_recovery import (
    Start,
    continued,
    crash,
    published,
    rerun_until_ok,
    start,
    write_config,
)
from tests.support.effect_log_env import LOG_ENV, EffectLogEnvironment
from tests.support.processes import kill_all, replica_servers, wait_gone
from tests.support.run_process import Finished

pytestmark = pytest.mark.chaos
__all__ = ["start"]  # the fixture, shared with the crash tests

CONCURRENCY = 8
TASKS = 24


def lines(path: Path, upto: int | None = None, *, live: bool = False) -> list[Any]:
    """The JSON lines of ``path`` (up to byte ``upto``). ``live``: the file is being
    written, and a read can see a line its writer has not finished: only whole lines."""
    if not path.exists():
        return []
    data = path.read_bytes()[:upto]
    if live:
        data = data[: data.rfind(b"\n") + 1]
    return [orjson.loads(raw) for raw in data.splitlines()]


SEEDS = [3, 11]
"""The random kill moments: each seeds the share of the job's policy calls done at the kill.
Each variant below runs at one of them, the two moments shared out across the variants: a
second moment for the same variant only re-ran the same code path (~25 s a run)."""

NO_SNAPSHOTS: dict[str, Any] = {
    "snapshot": {"every_seconds": 600},
    "train": {"batch_size": 4, "checkpoint_every_steps": 1000},
}
FREQUENT_SNAPSHOTS: dict[str, Any] = {
    "snapshot": {"every_seconds": 0.5},
    "train": {"batch_size": 4},
}
"""Sessions saved mid-episode: the rerun continues them under the next attempt."""


def logged_policy(log: Path) -> dict[str, Any]:
    """The scripted policy as these tests run it: its own call log at ``log``, token data
    required, each call's seed naming its (rollout, turn)."""
    return {
        "latency_ms": 60,
        "error_rate": 0,
        "capture_tokens": "required",
        "call_log": str(log),
        "sampling": {"logprobs": True, "temperature": 1.0, "seed": "turn"},
    }


def job(
    tmp_path: Path, *, journal: bool, snapshots: dict[str, Any] = NO_SNAPSHOTS
) -> tuple[Path, Path]:
    log = tmp_path / "engine.jsonl"
    config = write_config(
        tmp_path,
        environment="tests.support.effect_log_env:EffectLogEnvironment",
        tasks=TASKS,
        group_size=1,
        concurrency=CONCURRENCY,
        policy=logged_policy(log),
        journal={"enabled": journal},
        **snapshots,
    )
    return config, log


def kill_mid_run(
    start: Start, config: Path, log: Path, *, snapshots: int = 0, share: float = 1 / 3
) -> int:
    """Start the job, SIGKILL it once the engine has answered ``share`` of the calls the
    job makes (about 4 a row) and ``snapshots`` snapshots were published (the first is taken
    before any row: a later one holds episodes in flight); the engine log's size at the
    kill."""
    run = start(config)
    seen: set[str] = set()  # retention prunes: count every snapshot ever seen published

    def ready() -> bool:
        seen.update(published(config.parent / "run"))
        calls = episode_calls(lines(log, live=True))
        return len(calls) >= int(TASKS * 4 * share) and len(seen) >= snapshots

    run.wait_until(ready, f"{share:.0%} of the policy calls and {snapshots} snapshots")
    segments_at_kill.clear()
    crash(run)
    segments_at_kill.update(agent_segments(config.parent / "run"))
    return log.stat().st_size


segments_at_kill: dict[Path, int] = {}
"""Each agent journal segment there at the kill, with its size (filled by the kills)."""


def agent_segments(workdir: Path) -> dict[Path, int]:
    folder = workdir / invariants.SNAPSHOT_STORE_DIR / "journal" / "agent"
    return {p: p.stat().st_size for p in folder.glob("*/segment-*.rpj")}


def agent_turns(workdir: Path) -> list[tuple[bool, str, int, int]]:
    """Every turn record of the agents' journals, in journal order: (written before the
    kill, rollout id, attempt, turn)."""
    found = []
    for path in sorted(agent_segments(workdir)):
        data = path.read_bytes()
        before = segments_at_kill.get(path, 0)
        for frame in scan_frames(data, HEADER, len(data)):
            if isinstance(frame, Damage):
                break  # a tail torn by the kill: nothing after it is trusted
            if frame.kind == "turn":
                _, rollout_id, attempt, turn = frame.key.split("|")
                found.append((frame.end <= before, rollout_id, int(attempt[1:]), int(turn[1:])))
    return found


def assert_episodes_continued_at_their_last_journaled_turn(workdir: Path) -> int:
    """After the kill no episode journaled a turn before the last one it had journaled
    before it (each went on from there, not from its prompt); returns how many episodes
    had turns journaled before the kill and went on after it."""
    last_before: dict[str, int] = {}
    first_after: dict[str, int] = {}
    for before, rollout_id, _, turn in agent_turns(workdir):
        if before:
            last_before[rollout_id] = max(turn, last_before.get(rollout_id, -1))
        else:
            first_after.setdefault(rollout_id, turn)
    went_on = {r: t for r, t in first_after.items() if r in last_before}
    replayed = {r: (last_before[r], t) for r, t in went_on.items() if t < last_before[r]}
    assert not replayed, (
        f"episodes played again from an earlier turn (last, first after): {replayed}"
    )
    return len(went_on)


def episode_calls(found: list[Any]) -> list[Any]:
    """The lines of episodes' calls: the start checks' probe (no seed) left out."""
    return [line for line in found if "seed" in line["request"]]


def redone(log: Path, at_kill: int) -> tuple[list[int], list[Any]]:
    """The seeds (keys) the engine logged before the kill and again after it; the lines
    before the kill."""
    before = episode_calls(lines(log, at_kill))
    after = episode_calls([orjson.loads(raw) for raw in log.read_bytes()[at_kill:].splitlines()])
    seeds_after = Counter(line["request"]["seed"] for line in after)
    twice = [line["request"]["seed"] for line in before if seeds_after[line["request"]["seed"]]]
    return twice, before


@pytest.fixture
def effects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "effects.jsonl"
    monkeypatch.setenv(LOG_ENV, str(path))  # the run's servers inherit it
    return path


@pytest.mark.parametrize(
    ("snapshots", "seed"),
    [(NO_SNAPSHOTS, SEEDS[0]), (FREQUENT_SNAPSHOTS, SEEDS[1])],
    ids=["none", "every_0.5s"],
)
def test_a_killed_job_redoes_only_the_calls_in_flight_and_no_journaled_effect_twice(
    tmp_path: Path, start: Start, effects: Path, snapshots: dict[str, Any], seed: int
) -> None:
    config, log = job(tmp_path, journal=True, snapshots=snapshots)
    # With snapshots every 0.5 s the rerun must resume from one that saved episodes in
    # flight (on a loaded machine the kill could otherwise come before the second one).
    at_kill = kill_mid_run(
        start,
        config,
        log,
        snapshots=3 if snapshots is FREQUENT_SNAPSHOTS else 0,
        share=random.Random(seed).uniform(0.2, 0.7),
    )
    effects_at_kill = lines(effects)  # the servers are dead: nothing more is written
    reruns = rerun_until_ok(start, config)
    if snapshots is FREQUENT_SNAPSHOTS:
        assert continued(reruns[0]) > 0, reruns[0].stderr[-2000:]
    restore_line = _RESTORE_TURNS.search(reruns[0].stderr)
    assert restore_line, reruns[0].stderr[-2000:]
    assert int(restore_line.group("journal")) > 0, restore_line.group(0)
    if snapshots is NO_SNAPSHOTS:
        # (With snapshots every 0.5 s retention deletes the agents' pre-kill segments
        # during the rerun: their journals no longer show what came before the kill.)
        assert assert_episodes_continued_at_their_last_journaled_turn(tmp_path / "run") > 0
    check_after_the_kill(tmp_path, config, log, effects, at_kill, effects_at_kill, reruns[-1])
    if snapshots is FREQUENT_SNAPSHOTS:
        assert_journal_retention(tmp_path / "run")


@pytest.mark.parametrize(
    ("killed", "seed"),
    [("all", SEEDS[0]), ("one_model_server", SEEDS[1])],
    ids=["all", "one_model_server"],
)
def test_servers_killed_alone_redo_only_the_calls_in_flight(
    tmp_path: Path, start: Start, effects: Path, seed: int, killed: str
) -> None:
    """The replicas' servers SIGKILLed while the trainer lives: the runtime restarts them,
    the trainer sends every try they held back to them, and each goes on from its last
    journaled turn.

    ``one_model_server``: only replica-0's model server dies. Its agent lives on for a
    moment and fails the rows it was running as transport errors; those tries must wait
    for the runtime's down report and continue from the journals, not be re-sent fresh
    under new rollout ids (which ran every turn again, and made the effects again: seen
    when the six servers' deaths were noticed one by one)."""
    # Restarting a replica's three servers can take seconds on a loaded machine: its tries
    # wait as long as a snapshot may take (``snapshot.deadline_seconds``) before starting over.
    config, log = job(
        tmp_path,
        journal=True,
        snapshots={**NO_SNAPSHOTS, "snapshot": {"every_seconds": 600, "deadline_seconds": 60}},
    )
    workdir = tmp_path / "run"
    run = start(config)
    share = random.Random(seed).uniform(0.2, 0.7)
    run.wait_until(
        lambda: len(episode_calls(lines(log, live=True))) >= int(TASKS * 4 * share),
        f"{share:.0%} of the policy calls",
    )
    servers = [pid for r in ("replica-0", "replica-1") for pid in replica_servers(workdir, r)]
    assert len(servers) == 6, servers
    if killed == "one_model_server":
        servers = [pid for pid in servers if _is_model_server(pid, "replica-0")]
        assert len(servers) == 1, servers
    segments_at_kill.clear()
    # Six signals are not one instant. The trainer is frozen across them: running in
    # between, it would fill the slots a dying replica's failed rows free with new rows on
    # the replica still up, just before that one dies too (a cascade: more episodes than
    # ``concurrency`` then had a call in flight "at the kill"; seen on a loaded CI host, 9).
    os.kill(run.proc.pid, signal.SIGSTOP)
    try:
        kill_all(servers)
        assert wait_gone(servers, 10) == []
        # The engine finishes the calls it was sent (60 ms each) and logs them: they are the
        # calls in flight at the kill, and belong before it.
        settle_log(log)
        at_kill = log.stat().st_size
        effects_at_kill = lines(effects)
        segments_at_kill.update(agent_segments(workdir))
    finally:
        os.kill(run.proc.pid, signal.SIGCONT)
    finished = run.finish()
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert assert_episodes_continued_at_their_last_journaled_turn(workdir) > 0
    # The servers do not die at one instant (one by one, and with one model server killed
    # replica-1 goes on while replica-0 restarts): "the last calls before the kill" is then
    # not a window of the logs, and each episode's own last call and effect bound it.
    check_after_the_kill(
        tmp_path,
        config,
        log,
        effects,
        at_kill,
        effects_at_kill,
        finished,
        per_episode=True,
    )
    fresh = [line for line in finished.stderr.splitlines() if "under new rollout ids" in line]
    assert fresh == [], "tries of the killed servers started over:\n" + "\n".join(fresh)


def settle_log(log: Path, quiet_s: float = 0.3, timeout_s: float = 10) -> None:
    """Until ``log`` has not grown for ``quiet_s``."""
    size, since, give_up = log.stat().st_size, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() - since < quiet_s and time.monotonic() < give_up:
        time.sleep(0.05)
        if (now := log.stat().st_size) != size:
            size, since = now, time.monotonic()


def call_turns(workdir: Path, most_turns: int = 100) -> dict[int, tuple[str, int]]:
    """Each policy call's seed (``seed: turn``) to the (rollout id, turn) it names, for
    every rollout trained or journaled in ``workdir``."""
    rollouts = {r for _, r, _, _ in agent_turns(workdir)}
    rollouts.update(
        orjson.loads(raw)["rollout_id"]
        for raw in (workdir / "train_data.jsonl").read_bytes().splitlines()
    )
    return {turn_seed(r, t): (r, t) for r in rollouts for t in range(most_turns)}


def _is_model_server(pid: int, replica: str) -> bool:
    """``pid`` is ``replica``'s model server (its spec, on its command line, names it)."""
    return f'"name":"model-{replica}"'.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()


_RESTORE_TURNS = re.compile(
    r"turns: (?P<snapshot>\d+) continued from the snapshot, (?P<journal>\d+) replayed from the journal"
)


def assert_journal_retention(workdir: Path) -> None:
    """Each journal kept only what the snapshots left in the store need: segments from the
    oldest one their marks name, and segments were deleted on the way."""
    store = workdir / invariants.SNAPSHOT_STORE_DIR
    marks: dict[str, int] = {}
    for manifest in store.glob("snapshots/*/participants/*/*/manifest.json"):
        mark = orjson.loads(manifest.read_bytes()).get("journal")
        if mark is not None:
            marks[mark["folder"]] = min(mark["segment"], marks.get(mark["folder"], mark["segment"]))
    assert {f.split("/")[1] for f in marks} == {"agent", "model", "resources"}, marks
    for folder, oldest in marks.items():
        numbers = sorted(int(p.name[8:18]) for p in (store / folder).glob("segment-*.rpj"))
        assert numbers and numbers[0] >= oldest, (folder, numbers, oldest)
        assert numbers[0] > 1, f"{folder}: no segment was ever deleted ({numbers})"
    shown = {(j["kind"], j["instance"]): j for j in build_report(str(store))["journals"]}
    # Each journal is shown, undamaged (one may hold no record once retention went past it).
    assert len(shown) == 6, shown
    assert all(j["segments"] >= 1 and j["damage"] is None for j in shown.values()), shown
    assert sum(j["records"] for j in shown.values()) > 0, shown


def check_after_the_kill(
    tmp_path: Path,
    config: Path,
    log: Path,
    effects: Path,
    at_kill: int,
    effects_at_kill: list[Any],
    final: Finished,
    *,
    per_episode: bool = False,
) -> None:
    """Calls and effects done again are at most ``concurrency``, each its episode's last
    before the kill (an episode has one call in flight at a time). Unless ``per_episode``
    (the servers were not all stopped at one instant), also among the logs' last
    ``concurrency`` lines before the kill."""
    twice, before = redone(log, at_kill)
    named = call_turns(tmp_path / "run")
    assert all(s in named for s in twice), [s for s in twice if s not in named]
    assert len(twice) <= CONCURRENCY, (
        f"{len(twice)} policy calls done again (rollout, turn): {sorted(named[s] for s in twice)}"
    )
    # A call done again was its episode's last before the kill (the one in flight then):
    # one an episode had gone on past was answered to it and journaled.
    last_turn: dict[str, int] = {}
    for line in before:
        rollout, turn = named.get(line["request"]["seed"], ("", -1))
        last_turn[rollout] = max(turn, last_turn.get(rollout, -1))
    gone_past = sorted(named[s] for s in twice if named[s][1] != last_turn[named[s][0]])
    assert not gone_past, f"calls done again that their episode had gone on past: {gone_past}"
    if not per_episode:
        last = {line["request"]["seed"] for line in before[-CONCURRENCY:]}
        assert set(twice) <= last, "a call finished well before the kill was done again"

    # Every trained turn carries what the engine sampled for it (before or after the kill).
    logged = {line["id"]: line for line in lines(log)}
    pre_kill = {line["id"] for line in before}
    rollouts = [
        orjson.loads(raw)
        for raw in (tmp_path / "run" / "train_data.jsonl").read_bytes().splitlines()
    ]
    kept = 0
    for rollout in rollouts:
        for turn in rollout["turns"]:
            (choice,) = logged[turn["completion_id"]]["choices"]
            assert turn["completion_token_ids"] == choice["token_ids"]
            assert turn["completion_logprobs"] == as_float32(choice["logprobs"])
            kept += turn["completion_id"] in pre_kill
    assert kept > 0, "no turn sampled before the kill reached training"

    # Each effect reached the outside world, and a journaled one only once. A tool call in
    # flight at the kill (its effect written, its journal record not yet durable) is in
    # doubt: it runs again after the restore, as issue 36's effect intents will prevent. So,
    # as for policy calls: at most one repeated effect per call in flight (CONCURRENCY),
    # each among the last effects before the kill, and never a third time.
    loaded = load_config(config)
    tasks = load_tasks_for(loaded.job_settings())
    env = EffectLogEnvironment()
    expected = Counter((t.task_id, e) for t in tasks for e in env.expected_side_effects(t))
    seen = Counter((line["task"], line["effect"]) for line in lines(effects))
    assert set(seen) == set(expected), set(seen) ^ set(expected)
    assert set(expected.values()) == {1}
    repeated = {k for k, n in seen.items() if n > 1}
    assert all(seen[k] == 2 for k in repeated), {k: seen[k] for k in repeated}
    assert len(repeated) <= CONCURRENCY, f"{len(repeated)} effects made twice: {repeated}"
    # Each was its episode's last effect before the kill (the tool call in flight then).
    last_effect = {line["task"]: (line["task"], line["effect"]) for line in effects_at_kill}
    assert all(last_effect.get(task) == (task, e) for task, e in repeated), (
        f"effects made again that their episode had gone on past: {sorted(repeated)}"
    )
    if not per_episode:
        in_doubt = {(line["task"], line["effect"]) for line in effects_at_kill[-CONCURRENCY:]}
        assert repeated <= in_doubt, "an effect made well before the kill was made again"

    found = invariants.check_workdir(
        loaded.workdir,
        tasks,
        loaded.group_size,
        resumed_since=final.started_at,
        full_reward="all",
        final_states=loaded.final_states_log,
    )
    assert found == [], invariants.report(found)


def test_without_the_journal_the_same_kill_redoes_the_calls_and_effects(
    tmp_path: Path, start: Start, effects: Path
) -> None:
    """The baseline: the counts above have teeth."""
    config, log = job(tmp_path, journal=False)
    at_kill = kill_mid_run(start, config, log)
    rerun_until_ok(start, config)
    twice, before = redone(log, at_kill)
    assert len(twice) > CONCURRENCY and len(twice) >= len(before) // 2
    seen = Counter((line["task"], line["effect"]) for line in lines(effects))
    assert max(seen.values()) > 1
