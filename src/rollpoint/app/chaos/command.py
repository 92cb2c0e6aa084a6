"""``rollpoint chaos``: run one job many times under random faults and hold each to the
invariants (docs/design.md#invariants).

Owns the trials: for each plan of :func:`~rollpoint.app.chaos.plan.draw_plans` it
starts ``python -m rollpoint.app.chaos.trial`` in its own session (its servers share
its process group), SIGKILLs that whole group at the plan's moment when the plan says so,
reruns the trial until a run exits 0 (at most :data:`MAX_RERUNS` times), then checks the
trial's workdir with :func:`rollpoint.testing.invariants.check_workdir` and counts what the
trial's processes reported (faults that took effect, episodes continued and restarted)
and what its workdir holds (snapshots published and failed). :class:`ChaosTally` sums the
trials into one table and one JSON object.

Between two runs it damages the trial's newest snapshot when the plan says so
(:mod:`rollpoint.app.chaos.between_runs`, with :mod:`rollpoint.testing.snapshot_damage`).
After a trial whose policy corrupted calls it adds the engine-data checks
(:mod:`rollpoint.app.chaos.engine_checks`). It does not apply the in-process faults (the
trial process does) and draws no plan itself. A trial process seen from outside (its
start, its event lines, its process group) is :mod:`rollpoint.app.chaos.launch`'s; its
store watched while a run goes, :mod:`rollpoint.app.chaos.store_watch`'s.
Trials run one after another, or ``--jobs`` of them at once: each is a whole job with its
servers, in its own folder, on free ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO

import orjson
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rollpoint.app.chaos.between_runs import damage_between
from rollpoint.app.chaos.draw import draw_plans
from rollpoint.app.chaos.engine_checks import check_engine_data
from rollpoint.app.chaos.launch import (
    GONE_WAIT_S,
    LiveRun,
    kill_group,
    read_events,
    start_trial,
    wait_group_gone,
)
from rollpoint.app.chaos.plan import (
    MAX_RERUNS,
    OVERSIZED_CAP,
    PACK_DAMAGE_AFTER,
    ChaosFault,
    PlannedFault,
    TrialEvent,
    TrialPlan,
    final_states_dir,
    trial_store,
    trial_store_folder,
)
from rollpoint.app.chaos.store_watch import Published, journal_commit
from rollpoint.app.chaos.tally import ChaosTally, RunRecord, TrialOutcome
from rollpoint.app.config import RunConfig, load_config
from rollpoint.job.tasks import load_tasks_for
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import ConfigError, LaunchError, RollpointError
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.store.workdir_lock import LOCK_NAME
from rollpoint.testing import invariants
from rollpoint.testing.invariants import Invariant, RewardScope, Violation

_SECOND_RUN_WAIT_S = 60.0
"""A second run on a locked workdir is refused within seconds (its imports, its lock)."""
_BUSY = "is in use by"
"""What the refusal of a second run on a workdir says (rollpoint.store.workdir_lock)."""
_OTHER_JOB = "give each job its own snapshot.store"
"""What the refusal of another job on a snapshot store says (rollpoint.store.job_identity)."""
_SERVE_START_S = 120.0


class ChaosRunner:
    """Runs the trials of one job config; each trial alone, in its own workdir."""

    def __init__(self, config_path: Path, config: RunConfig, *, run_timeout_s: float) -> None:
        """``run_timeout_s``: a run still going after this long is wedged: it is killed,
        rerun, and counted as an I4 violation."""
        self.config_path = config_path.resolve()
        self.config = config
        self.root = config.workdir.resolve() / "chaos"
        self.run_timeout_s = run_timeout_s
        self.tasks: list[TaskRow] = load_tasks_for(config.job_settings())

    async def trial(self, plan: TrialPlan) -> TrialOutcome:
        started = time.monotonic()
        shutil.rmtree(plan.workdir, ignore_errors=True)
        plan.workdir.mkdir(parents=True)
        runs: list[RunRecord] = []
        not_served: LaunchError | None = None
        with (plan.workdir / "stderr.log").open("ab") as stderr:
            try:
                async with self._servers_apart(plan, stderr) as plan:
                    for run in range(MAX_RERUNS + 1):
                        this = plan.model_copy(update={"run": run})
                        runs.append(await self._run(this, stderr, before=damage_between(this)))
                        if runs[-1].returncode == 0:
                            break
            except LaunchError as exc:
                # The trial's servers never came up (the one LaunchError raised here): the
                # job did not go on, a violation of its own (I4), counted with the others;
                # the campaign goes on.
                not_served = exc
        violations = (
            self.check(plan, runs)
            if not_served is None
            else [Violation(Invariant.SNAPSHOTS_COMMIT, "servers", not_served.message)]
        )
        return TrialOutcome(
            trial=plan.trial,
            plan=plan,
            runs=runs,
            snapshots=invariants.snapshot_outcomes(plan.workdir),
            violations=violations,
            seconds=time.monotonic() - started,
        )

    def check(self, plan: TrialPlan, runs: list[RunRecord]) -> list[Violation]:
        """I1 to I4 on the trial's workdir, I4 from the end of the final run's last fault.
        Every fault is one the job must survive, so a run that stopped by itself or had
        to be killed for hanging did not go on after it: a wedge (I4) of its own."""
        found = invariants.check_workdir(
            plan.workdir,
            self.tasks,
            self.config.group_size,
            resumed_since=runs[-1].settled_since(),
            full_reward=self._reward_scope(),
            final_states=final_states_dir(plan),
            # The store the trial's runs were configured with (trial_config).
            store=trial_store(plan),
        )
        found += _damaged_pack_named(plan, runs)
        found += check_engine_data(
            plan,
            runs,
            engine=self.config.policy.engine,
            cap=min(self.config.max_reply_bytes, OVERSIZED_CAP),
        )
        for r in runs:
            found += [Violation(Invariant.EXACTLY_ONCE, f"run {r.run}", p) for p in r.intruders]
            if r.timed_out:
                detail = f"wedged: no exit within {self.run_timeout_s:.0f}s"
            elif r.failed:
                detail = f"stopped by itself (exit {r.returncode}): {r.error or 'see stderr.log'}"
            else:
                continue
            found.append(Violation(Invariant.SNAPSHOTS_COMMIT, f"run {r.run}", detail))
        return found

    def _reward_scope(self) -> RewardScope:
        """Every rollout must reach full reward only where the policy never blunders and
        full reward is what a finished task earns (workplace)."""
        policy = self.config.policy
        flawless = policy.base_url is None and policy.error_rate == 0
        return "all" if flawless and self.config.environment == "workplace" else "none"

    @contextlib.asynccontextmanager
    async def _servers_apart(self, plan: TrialPlan, stderr: IO[bytes]) -> AsyncIterator[TrialPlan]:
        """For a trial with a trainer kill: its servers under ``rollpoint serve``, in a
        session of their own (the kill spares them), for all its runs; the plan then names
        the deployment they printed. Stopped (SIGTERM, then SIGKILL) when the trial ends."""
        if not plan.servers_apart:
            yield plan
            return
        folder = plan.workdir / "servers"
        folder.mkdir()
        doc = self.config.model_dump(mode="json") | {
            "workdir": str(folder),
            "base_port": None,
            "final_states_log": str(final_states_dir(plan)),
        }
        doc["snapshot"] = doc["snapshot"] | {"store": trial_store(plan)}
        config = folder / "serve.yaml"
        config.write_text(yaml.safe_dump(doc))
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rollpoint",
            "serve",
            str(config),
            "--json",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
            env={**os.environ, "NO_COLOR": "1"},
        )
        try:
            assert process.stdout is not None
            try:
                async with asyncio.timeout(_SERVE_START_S):
                    line = await process.stdout.readline()
            except TimeoutError:
                raise LaunchError(
                    f"trial {plan.trial}: rollpoint serve printed no deployment within "
                    f"{_SERVE_START_S:g}s; see stderr.log"
                ) from None
            if not line:
                raise LaunchError(f"trial {plan.trial}: rollpoint serve exited; see stderr.log")
            served = plan.workdir / "served.json"
            served.write_bytes(line)
            yield plan.model_copy(update={"served": served})
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(GONE_WAIT_S):
                    await process.wait()
            except TimeoutError:
                kill_group(process.pid)
                await process.wait()
            kill_group(process.pid)  # a server that outlived serve itself
            await asyncio.to_thread(wait_group_gone, process.pid)

    async def _run(
        self, plan: TrialPlan, stderr: IO[bytes], *, before: list[TrialEvent]
    ) -> RunRecord:
        process = await start_trial(plan, stdout=asyncio.subprocess.PIPE, stderr=stderr)
        kills = plan.kills()
        record = RunRecord(run=plan.run, started_at=time.time(), events=list(before))
        if kills:
            record.kill = kills[0].kind
        live = LiveRun(process, record)
        helpers = [asyncio.create_task(read_events(live, plan.workdir / "events.jsonl"))]
        published = Published(trial_store_folder(plan))
        # A shared records file damaged before the next run: once the store keeps a fallback.
        damaged_next = any(
            f.kind is ChaosFault.PACK_DAMAGE and f.run == plan.run + 1 for f in plan.faults
        )
        at_least = PACK_DAMAGE_AFTER if damaged_next else 0
        helpers += [asyncio.create_task(self._kill_at(live, f, published, at_least)) for f in kills]
        helpers += [
            asyncio.create_task(self._second_run_at(live, plan, f)) for f in plan.second_runs()
        ]
        try:
            async with asyncio.timeout(self.run_timeout_s):
                await process.wait()
        except TimeoutError:
            live.record.timed_out = True
        finally:
            # Whatever is left of the group goes: servers of a killed or hung run, or of
            # this one when the chaos run itself is interrupted.
            kill_group(process.pid)
            await process.wait()
            for task in helpers[1:]:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            await asyncio.to_thread(wait_group_gone, process.pid)
        live.record.returncode = process.returncode
        return live.record

    async def _second_run_at(self, live: LiveRun, plan: TrialPlan, fault: PlannedFault) -> None:
        """Start the same run again on the trial's workdir while the first one runs (for a
        ``lock_tamper``, once its lock file was deleted or replaced), or another job on
        its snapshot store (``second_job``); it must be refused at once, naming the
        holder or both jobs. Its events are not the trial's."""
        await live.up.wait()
        await asyncio.sleep(fault.at_s)
        if live.process.returncode is not None:
            return  # the run ended first: not injected
        expected = _BUSY
        second_plan = plan
        if fault.kind is ChaosFault.LOCK_TAMPER:
            _tamper_lock(plan.workdir, fault.how or "deleted")
        elif fault.kind is ChaosFault.SECOND_JOB:
            expected = _OTHER_JOB
            second_plan = TrialPlan(
                trial=plan.trial,
                config=plan.config,
                workdir=plan.workdir / "second-job",
                store_of=plan.workdir,
            )
            second_plan.workdir.mkdir(exist_ok=True)
        second = await start_trial(
            second_plan, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        struck = time.time()
        try:
            async with asyncio.timeout(_SECOND_RUN_WAIT_S):
                _, err = await second.communicate()
        except TimeoutError:
            err = b""
        finally:
            kill_group(second.pid)
            await second.wait()
        said = err.decode(errors="replace").strip().splitlines()
        refused = second.returncode not in (0, None, -signal.SIGKILL) and any(
            expected in line for line in said
        )
        event = TrialEvent(
            event="fault",
            ts=struck,
            kind=fault.kind,
            detail=fault.describe(),
            reason=said[-1] if said else f"exit {second.returncode}",
        )
        live.record.events += [event, event.model_copy(update={"event": "over"})]
        if not refused:
            what = (
                "another job on the snapshot store"
                if fault.kind is ChaosFault.SECOND_JOB
                else "a second run on the workdir"
            )
            live.record.intruders.append(
                f"{what} was not refused at once ({fault.describe()}; exit {second.returncode}"
                f"{': ' + said[-1] if said else ''})"
            )

    async def _kill_at(
        self, live: LiveRun, fault: PlannedFault, published: Published, at_least: int
    ) -> None:
        """The plan's kill, at its moment; not before ``at_least`` snapshots of any kind
        were published by this run."""
        await live.up.wait()
        await published.wait_for(fault.after_snapshots)
        await published.wait_for(at_least, with_episodes=False)
        await asyncio.sleep(fault.at_s)
        if fault.kind is ChaosFault.JOURNAL_COMMIT_KILL:
            live.record.in_commit = await journal_commit(published.store, live)
        if live.process.returncode is None:
            kill_group(live.process.pid)
            live.record.killed_at = time.time()


def _damaged_pack_named(plan: TrialPlan, runs: list[RunRecord]) -> list[Violation]:
    """I4 after a ``pack_damage_live``: the newest snapshot, when published after the
    damage, verifies whole (a damaged records file is written again, never named again).
    One published before it is not judged: it named the file while it was whole."""
    struck = [
        e.ts
        for r in runs
        for e in r.events
        if e.event == "fault" and e.kind is ChaosFault.PACK_DAMAGE_LIVE
    ]
    if not struck:
        return []
    store = SnapshotStore(str(trial_store_folder(plan)), clean_leftovers=False)
    latest = store.latest()
    if latest is None or latest.published_at <= max(struck):
        return []
    try:
        store.verify(latest.snapshot_id)
    except (RollpointError, OSError) as exc:
        why = exc.message if isinstance(exc, RollpointError) else str(exc)
        return [
            Violation(
                Invariant.SNAPSHOTS_COMMIT,
                f"snapshot {latest.snapshot_id}",
                f"published after a shared records file was damaged, it does not verify: {why}",
            )
        ]
    return []


def _tamper_lock(workdir: Path, how: str) -> None:
    """What an operator clearing a "stale lock" does: delete the lock file, or put another
    file in its place (written beside it, renamed over it)."""
    lock = workdir / LOCK_NAME
    if how == "deleted":
        lock.unlink(missing_ok=True)
        return
    other = workdir / f"{LOCK_NAME}.chaos"
    other.write_text("0\n")
    other.replace(lock)


# --- the command ---------------------------------------------------------------------------


async def run_chaos(
    runner: ChaosRunner,
    plans: list[TrialPlan],
    tally: ChaosTally,
    console: Console,
    *,
    jobs: int = 1,
) -> None:
    """Run every plan, ``jobs`` trials at once; the tally lists them in trial order.
    Progress: a bar on a terminal, one plain line per finished trial in a pipe or a log."""
    columns = (
        TextColumn("[bold]trials"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("faults {task.fields[faults]} · violations {task.fields[violations]}"),
        TimeElapsedColumn(),
    )
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        progress = None
        if console.is_terminal:
            progress = stack.enter_context(Progress(*columns, console=console, transient=False))
            bar = progress.add_task("trials", total=len(plans), faults=0, violations=0)
        gate = asyncio.Semaphore(jobs)

        async def one(plan: TrialPlan) -> None:
            async with gate:
                outcome = await runner.trial(plan)
            tally.add(outcome)
            faults = sum(tally.faults_injected.values())
            violations = sum(tally.violations_by_kind.values())
            if progress is not None:
                progress.update(bar, advance=1, faults=faults, violations=violations)
                return
            elapsed = int(time.monotonic() - started)
            console.print(
                f"trial {outcome.trial} done · trials {len(tally.outcomes)}/{len(plans)} · "
                f"faults {faults} · violations {violations} · {elapsed // 60}:{elapsed % 60:02d}",
                highlight=False,
                soft_wrap=True,
            )

        try:
            # A task group, not gather: cancelled (Ctrl-C), gather returns as soon as one
            # trial ends cancelled, and the runner then cancels the others again while
            # they reap their processes (a trial process left unreaped when the loop
            # closed, and a traceback from its transport: a CI run). The group waits for
            # every trial to finish its cleanup.
            async with asyncio.TaskGroup() as group:
                for plan in plans:
                    group.create_task(one(plan))
        finally:
            tally.outcomes.sort(key=lambda o: o.trial)


def chaos_command(
    config_path: Path,
    *,
    trials: int,
    seed: int,
    json_path: Path | None,
    verbose: bool,
    within_s: float,
    run_timeout_s: float,
    jobs: int = 1,
    console: Console,
    out: Console,
) -> int:
    """The ``rollpoint chaos`` command; returns its exit code (0: no violation, 1: some,
    2: bad input)."""
    try:
        if trials < 1:
            raise ConfigError(f"--trials must be at least 1, got {trials}")
        if within_s <= 0 or run_timeout_s <= 0:
            raise ConfigError("--within and --run-timeout must be positive")
        if jobs < 1:
            raise ConfigError(f"--jobs must be at least 1, got {jobs}")
        config = load_config(config_path)
        runner = ChaosRunner(config_path, config, run_timeout_s=run_timeout_s)
    except RollpointError as exc:
        console.print(f"[bold red]error:[/] {exc.message}", highlight=False, soft_wrap=True)
        return 2
    plans = draw_plans(
        trials,
        seed,
        config=runner.config_path,
        root=runner.root,
        replicas=config.replicas,
        within_s=within_s,
        journaled=config.journal.enabled,
    )
    tally = ChaosTally(seed=seed, config=str(config_path))
    interrupted = False
    try:
        asyncio.run(run_chaos(runner, plans, tally, console, jobs=jobs))
    except KeyboardInterrupt:
        # What finished is still reported (and written): an hour of trials is not lost
        # to a Ctrl-C; the exit code says the run was cut short.
        interrupted = True
        tally.outcomes.sort(key=lambda o: o.trial)
        console.print(f"[yellow]interrupted[/] after {len(tally.outcomes)} trial(s)")
    for table in tally.tables(verbose=verbose):
        out.print(table)
    if tally.violations:
        out.print(invariants.report(tally.violations), highlight=False, soft_wrap=True)
    if json_path is not None:
        json_path.write_bytes(orjson.dumps(tally.to_json(), option=orjson.OPT_INDENT_2))
    return 130 if interrupted else tally.exit_code
