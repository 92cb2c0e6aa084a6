"""One run of one chaos trial: ``python -m rollpoint.app.chaos.trial PLAN_JSON``.

Owns a single process of a trial (see :mod:`rollpoint.app.chaos.plan`): it points the
job's config at the trial's workdir (with the scripted policy's ``policy.faults`` for the
engine-data faults of this run), runs the job (fresh on run 0, resuming on a rerun)
with a fault proxy in front of every participant its plan targets, applies the plan's
faults of this run at their moments, and prints what happened as
:class:`~rollpoint.app.chaos.plan.TrialEvent` JSON lines on stdout, flushed one by
one so a runner that SIGKILLs it keeps every line printed before the kill. Messages go to
stderr and logs to ``<workdir>/rollpoint.log``.

It does not kill itself, rerun, or judge the outcome (the runner in
:mod:`rollpoint.app.chaos.command` does). Exit code 0: the job finished; 1: it failed; 2: bad
plan or config (or a run refused: another run holds the workdir, another job the store);
3: it stopped early, with a snapshot, because too many groups failed
(``failure.max_failed_fraction``), as ``rollpoint run`` exits.

The faults it applies are :class:`~rollpoint.app.chaos.trial_faults.TrialFaults`'s; what
it prints and logs, and where, is :mod:`rollpoint.app.chaos.trial_output`'s.
"""

from __future__ import annotations

import asyncio
import sys
import time

from pydantic import ValidationError

from rollpoint.app import exit_codes
from rollpoint.app.chaos.plan import (
    ENGINE_DATA,
    OVERSIZED_CAP,
    STREAMED,
    ChaosFault,
    PlannedFault,
    TrialEvent,
    TrialPlan,
    engine_fault_log,
    final_states_dir,
    trial_store,
)
from rollpoint.app.chaos.trial_faults import TrialFaults
from rollpoint.app.chaos.trial_output import emit, say, setup_logging
from rollpoint.app.config import RunConfig, load_config
from rollpoint.job.run import run_job
from rollpoint.loop import SimulatedTrainer
from rollpoint.protocol.deployment import ServedDeployment
from rollpoint.protocol.engine_faults import EngineFault
from rollpoint.protocol.errors import ConfigError, GroupsFailedError, RollpointError
from rollpoint.store.workdir_lock import lock_workdir
from rollpoint.trainer.trainer import RunSummary

__all__ = ["emit", "main", "run_trial", "say", "trial_config"]


def trial_config(plan: TrialPlan) -> RunConfig:
    """The job's config in the trial's workdir, with its snapshot store inside it and free
    ports: trials must not share state or collide with servers still dying."""
    config = load_config(plan.config)
    # Servers apart name the store by its path; the trainer must name it alike.
    snapshot = config.snapshot.model_copy(update={"store": trial_store(plan)})
    update: dict[str, object] = {
        "workdir": plan.workdir,
        "base_port": None,
        "snapshot": snapshot,
        "final_states_log": final_states_dir(plan),
    }
    planned = {f.kind for f in plan.faults}
    if ChaosFault.OVERSIZED_REPLY in planned:
        # Every run of the trial alike: a rerun reads the replies of the same episodes.
        update["max_reply_bytes"] = min(config.max_reply_bytes, OVERSIZED_CAP)
    if planned & ENGINE_DATA and config.policy.base_url is None:
        policy: dict[str, object] = {
            "faults": [
                _engine_fault(f, min(config.max_reply_bytes, OVERSIZED_CAP))
                for f in plan.faults
                if f.kind in ENGINE_DATA and f.run == plan.run
            ],
            "fault_log": engine_fault_log(plan),
        }
        if planned & STREAMED and not config.policy.capture_tokens:
            # The model servers then stream every call from the engine (the generation
            # cut): a stream to spoil. Every run alike, as the oversized cap.
            policy["capture_tokens"] = True
        update["policy"] = config.policy.model_copy(update=policy)
    return config.model_copy(update=update)


def _engine_fault(fault: PlannedFault, cap: int) -> EngineFault:
    """The scripted policy's fault setting for one planned engine-data fault."""
    if fault.kind is ChaosFault.OVERSIZED_REPLY:
        # A quarter over the cap: the episode's reply is over it whatever else it holds.
        return EngineFault(corrupt="oversized_reply", calls=[fault.call], pad_bytes=cap + cap // 4)
    if fault.kind is ChaosFault.BAD_TOKEN_DATA:
        return EngineFault(
            corrupt="token_data",
            calls=[fault.call],
            how=fault.how,
        )
    return EngineFault(corrupt="tool_call_id", calls=[fault.call])


async def run_trial(plan: TrialPlan, config: RunConfig) -> RunSummary:
    faults = TrialFaults(plan, config)
    try:
        attach = (
            None
            if plan.served is None
            else ServedDeployment.model_validate_json(plan.served.read_bytes())
        )
        return await run_job(
            config.job_settings(),
            fresh=plan.run == 0,
            hooks=SimulatedTrainer(config.train.step_seconds),
            say=say,
            drive=faults.drive,
            route=faults.route,
            spec_hook=faults.spec_hook if faults.hooks_specs and attach is None else None,
            attach=attach,
        )
    finally:
        await faults.aclose()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m rollpoint.app.chaos.trial PLAN_JSON", file=sys.stderr)
        return 2
    try:
        plan = TrialPlan.model_validate_json(args[0])
    except ValidationError as exc:
        print(f"error: bad trial plan: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    try:
        config = trial_config(plan)
        lock_workdir(config.workdir)  # one run per trial folder, taken before its log
        setup_logging(config)
        summary = asyncio.run(run_trial(plan, config))
    except RollpointError as exc:
        emit(TrialEvent(event="error", ts=time.time(), detail=exc.message))
        print(f"error: {exc.message}", file=sys.stderr)
        if isinstance(exc, GroupsFailedError):
            # As `rollpoint run` exits: stopped early on failure.max_failed_fraction, with
            # a snapshot. Not a run that failed by itself: the rows the failed groups
            # never trained are I1's to count.
            return exit_codes.GROUPS_FAILED
        return 2 if isinstance(exc, ConfigError) else 1
    emit(TrialEvent(event="finished", ts=time.time(), detail=summary.model_dump_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
