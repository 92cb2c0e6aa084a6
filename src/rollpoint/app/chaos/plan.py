"""What one chaos trial will suffer, and when: the plan the runner draws and a trial obeys.

Owns the fault vocabulary of ``rollpoint chaos`` (:class:`ChaosFault`, one member per kind
the table counts), the plan of one trial (:class:`TrialPlan`, passed as JSON on the trial
process's command line), the events a trial process prints (:class:`TrialEvent`, one JSON
line each on stdout), and the shares and bounds the plans are drawn with
(:mod:`rollpoint.app.chaos.draw` draws them from one ``random.Random(seed)``).

Moments are seconds after a run's servers are up. Whole-process kills are the runner's
(it owns the process group), and so is damage to the trial's snapshots between two runs;
every other fault is applied inside the trial process, on the run the plan names (the
engine-data kinds by the scripted policy that process starts: ``policy.faults``). It does not run, kill or check anything.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from rollpoint.protocol.control import Verb
from rollpoint.protocol.engine_faults import TokenDataHow
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store.record_packs import REBASE_EVERY
from rollpoint.testing.faulty_store import store_url
from rollpoint.testing.journal_damage import JournalDamage
from rollpoint.testing.snapshot_damage import Damage

MAX_RERUNS = 4
"""Reruns of a trial after its first run, until one exits 0."""
EARLY_S = 0.5
"""A lost row stream reply is planned this early in a run: streams open as groups go out."""


class ChaosFault(StrEnum):
    """The kinds of fault a trial can suffer."""

    PROCESS_KILL = "process_kill"
    """SIGKILL of the trial's whole process group (trainer and servers); then a rerun."""
    TRAINER_KILL = "trainer_kill"
    """SIGKILL of the trainer alone: the trial's servers run under ``rollpoint serve`` in a
    process group of their own and live on; the rerun attaches to them again."""
    REPLICA_KILL = "replica_kill"
    """SIGKILL of one replica's server processes; the runtime restarts the replica."""
    PARTICIPANT_RESTART = "participant_restart"
    """One server of a replica SIGKILLed and started again on the same address, empty,
    after ``seconds`` (a container restarted behind a stable address): the runtime sees no
    replica go down, the trainer a participant unreachable for a while that comes back
    having forgotten everything."""
    REPLICA_STOP = "replica_stop"
    """SIGSTOP of one replica's server processes, SIGCONT a moment later: they wake up
    past their leases and deadlines, with requests queued on their sockets."""
    LOST_RUN_REPLY = "lost_run_reply"
    """One ``POST /run`` row stream runs to its end on the agent, and its reply is lost."""
    LOST_CONTROL_REPLY = "lost_control_reply"
    """A participant applies a commit or a resume, and its reply is lost."""
    PARTITION = "partition"
    """A participant's control routes are unreachable for a moment (refused), then heal."""
    SLOW_PREPARE = "slow_prepare"
    """A participant's prepare reaches it late."""
    CLOCK_SKEW = "clock_skew"
    """One participant's control clock runs ahead or behind the trainer's, within the
    protocol's tolerance (:data:`CLOCK_SKEW_S`), for the whole run: every deadline and
    lease it keeps is read against it."""
    PEER_PARTITION = "peer_partition"
    """An agent's link to its model or resources server is cut for a moment (refused),
    then heals; with ``forward`` the request that cuts it reaches the peer, which acts (a
    tool call applied), and its reply is lost."""
    STORE_FULL = "store_full"
    """Every write to the snapshot store fails (``ENOSPC`` or ``EIO``) for a moment, for the
    trainer and every participant alike; then the disk has room again."""
    SECOND_RUN = "second_run"
    """A second run of the trial started on its workdir while the first runs (a scheduler
    retrying a job still being torn down): it must be refused, naming the holder, before
    it touches anything."""
    SNAPSHOT_TAMPER = "snapshot_tamper"
    """Between a kill and the rerun, the newest published snapshot is damaged (a byte of a
    file, a sealed field, or its manifest gone: :mod:`rollpoint.testing.snapshot_damage`);
    the rerun must skip it and resume from the one before."""
    LOCK_TAMPER = "lock_tamper"
    """While a run holds the workdir, its ``.rollpoint.lock`` is deleted or replaced by
    another file (an operator clearing a "stale lock"), then a second run is started on the
    workdir: it must still be refused, naming the holder (issue 33: it ran beside the
    first, rows trained twice). Checked as ``second_run`` is (I1)."""
    SECOND_JOB = "second_job"
    """While a run goes, another job (a fresh workdir of its own) is started on the
    trial's snapshot store: it must be refused in one line naming both jobs, before its
    retention touches the first job's snapshots (I1: not refused; I1 and I4 of the first
    job's rows and snapshots)."""
    PACK_DAMAGE = "pack_damage"
    """Between a kill and the rerun, the shared records file (``objects/``) named by the
    most kept snapshots is damaged at rest (a byte flipped, cut short, or deleted:
    :func:`rollpoint.testing.snapshot_damage.damage_shared_pack`); the rerun must fall back
    to a snapshot that does not need it, not refuse the run (I4), and train every row once
    (I1)."""
    JOURNAL_TORN_TAIL = "journal_torn_tail"
    """Between a process kill and the rerun, a torn record (half of one) at the end of the
    newest segment of one participant's journal (``participant``: which kind; the one of
    that kind written last): :mod:`rollpoint.testing.journal_damage`. The rerun's server
    cuts it with a warning naming the file, and the run goes on (I1 to I4). Drawn only
    for a job with ``journal.enabled``, as the other journal faults."""
    JOURNAL_CORRUPT_RECORD = "journal_corrupt_record"
    """Between a process kill and the rerun, one byte of a journal's newest record
    flipped: cut before it with a warning; its call is done again, as one in flight."""
    JOURNAL_COMMIT_KILL = "journal_commit_kill"
    """A process kill timed into a group commit: at its moment the runner waits until a
    journal segment of the trial's store grows (a commit's records being written, their
    callers not yet answered) and SIGKILLs the trial's group then (:data:`COMMIT_WAIT_S`
    at most). The rerun finds those records or not, but never half of one, and answers
    their calls from the journal or does them again (I1 to I4). Drawn for a job with
    ``journal.enabled`` in place of a share of its process kills."""
    JOURNAL_LOST_SEGMENT = "journal_lost_segment"
    """Between a process kill and the rerun, the segment before a journal's newest one
    deleted: the journal is cut where the one before it ends, with a warning naming the
    lost file, and nothing after it is trusted."""
    CHECKPOINT_KILL = "checkpoint_kill"
    """One replica's server processes SIGKILLed at the next save's capture point
    (``coordinator.before_capture``): with ``snapshot.mode: journal``, after each of them
    wrote its checkpoint and before the snapshot is published (issue 37); in a cut, inside
    its pause, every participant prepared. The runtime restarts the replica."""
    PACK_DAMAGE_LIVE = "pack_damage_live"
    """While the run goes, once it published snapshots, the shared records file named by
    the most of them is damaged (a byte flipped): the snapshots after it must not name it
    damaged (the trainer writes it again), so the newest one verifies whole when the trial
    ends (I4), and the run goes on (I4)."""
    OVERSIZED_REPLY = "oversized_reply"
    """The scripted policy pads one call's reply (``call``: which of the run's calls) so
    its episode's reply outgrows ``max_reply_bytes`` (the trial lowers it to
    :data:`OVERSIZED_CAP`): that row's try fails naming the size and the cap and is re-sent
    fresh; no padded reply is trained, every row trained once (I1)."""
    BAD_TOKEN_DATA = "bad_token_data"
    """The scripted policy streams one call (``call``: which of the run's streamed calls)
    with a bad token id (2**31, ``"13"``, ``13.0``, -1) or logprob (0.5, ``"x"``, null) in
    a chunk (``how``); the trial turns token capture on, so the model servers stream and
    cut calls: that call fails naming the engine and the field, its row is re-sent, and
    nothing bad is trained (I1)."""
    TOOL_CALL_WITHOUT_ID = "tool_call_without_id"
    """The scripted policy streams one tool call (``call``: which of the run's streamed
    tool calls) without its ``id``: a transport error on that call (naming the field), its
    row re-sent, not a 400 that fails the group (I1)."""


KILLS = frozenset(
    {ChaosFault.PROCESS_KILL, ChaosFault.TRAINER_KILL, ChaosFault.JOURNAL_COMMIT_KILL}
)
"""The runner's faults: it SIGKILLs the trial process's group (with the servers in it, or
not when they run under ``rollpoint serve``)."""
RUNNER_DURING = frozenset({ChaosFault.SECOND_RUN, ChaosFault.LOCK_TAMPER, ChaosFault.SECOND_JOB})
"""The runner's other faults during a run: it starts a second run beside it (after
tampering with the lock file), or a second job on the trial's store."""
JOURNAL_DAMAGES = {
    ChaosFault.JOURNAL_TORN_TAIL: JournalDamage.TORN_TAIL,
    ChaosFault.JOURNAL_CORRUPT_RECORD: JournalDamage.CORRUPT_RECORD,
    ChaosFault.JOURNAL_LOST_SEGMENT: JournalDamage.LOST_SEGMENT,
}
"""The journal faults, each with the damage it does (issue 35)."""
COMMIT_KILL_SHARE = 0.3
"""Of a journaling job's process kills, this share are timed into a group commit
(``journal_commit_kill``)."""
COMMIT_WAIT_S = 5.0
"""How long a ``journal_commit_kill`` waits for a commit before it kills anyway."""
JOURNAL_DAMAGE_SHARE = 0.5
"""Of the trials of a journaling job drawn with a process kill, this share damage a
journal before the rerun."""
BETWEEN_RUNS = frozenset({ChaosFault.SNAPSHOT_TAMPER, ChaosFault.PACK_DAMAGE, *JOURNAL_DAMAGES})
"""The runner's faults on the trial's folder, after one run ended and before the next."""
IN_PROCESS = frozenset(set(ChaosFault) - KILLS - BETWEEN_RUNS - RUNNER_DURING)
"""Faults the trial process applies itself."""
SECOND_RUN_SHARE = 0.15
"""Of all trials, this share start a second run on the workdir while one runs."""
ENGINE_DATA = frozenset(
    {ChaosFault.OVERSIZED_REPLY, ChaosFault.BAD_TOKEN_DATA, ChaosFault.TOOL_CALL_WITHOUT_ID}
)
"""Faults the scripted policy makes itself, on the call the plan names (``policy.faults``,
set by the trial for the run it names): a fault proxy cannot rewrite a stream."""
STREAMED = frozenset({ChaosFault.BAD_TOKEN_DATA, ChaosFault.TOOL_CALL_WITHOUT_ID})
"""Engine-data faults in streamed calls: a trial planning one runs with token capture on
(the model servers then stream every call from the engine, to cut it at a snapshot)."""
ENGINE_SHARES = {
    ChaosFault.OVERSIZED_REPLY: 0.1,
    ChaosFault.BAD_TOKEN_DATA: 0.1,
    ChaosFault.TOOL_CALL_WITHOUT_ID: 0.1,
}
"""Of the trials whose servers are their own (no trainer kill), the share that suffer
each of issue 33's engine-data breaks; drawn from a generator of their own
(:func:`draw_plans`), so every fault drawn before they existed stays what it was."""
ENGINE_CALLS = (1, 24)
"""Which call of its kind an engine-data fault hits, drawn in this range."""
OVERSIZED_CAP = 256 * 1024
"""A trial with an ``oversized_reply`` caps episode replies at this (or the config's
smaller ``max_reply_bytes``): a 4 MiB padding is not needed to test a cap."""
DRAWN_APART = frozenset({ChaosFault.PACK_DAMAGE_LIVE, ChaosFault.CHECKPOINT_KILL}) | ENGINE_DATA
"""In-process faults drawn on their own after the others (:data:`LATER_SHARES`), so the
faults every seed drew before they existed stay what they were."""
LATER_SHARES = {
    ChaosFault.LOCK_TAMPER: 0.1,
    ChaosFault.SECOND_JOB: 0.1,
    ChaosFault.PACK_DAMAGE_LIVE: 0.15,
}
"""Of all trials, the share that suffer each of these (issue 33's breaks)."""
CHECKPOINT_KILL_SHARE = 0.15
"""Of the trials whose servers are the trial's own, the share that kill a replica at a
save's capture point (drawn last of all: every other fault of a seed stays as it was)."""
PACK_DAMAGE_SHARE = 0.25
"""Of the trials drawn with a kill, this share damage a shared records file before the
rerun."""
PACK_DAMAGE_AFTER = REBASE_EVERY + 1
"""The kill before a ``pack_damage`` waits for this many snapshots published by its run (the
runner sees to it): the store keeps a fallback from the second on (the second write
rebases), and past the ``REBASE_EVERY`` th the fallback is a later rebase's, whose train
checkpoint is one retention keeps anyway (docs/RELIABILITY.md)."""
LOCK_TAMPERING = ("deleted", "replaced")
PACK_DAMAGES = ("flip", "truncate", "delete")
TAMPER_SHARE = 0.3
"""Of the trials drawn with a kill, this share damage a snapshot before the rerun."""
TRAINER_KILL_SHARE = 0.3
"""Of the trials drawn with a kill, this share kill the trainer alone."""
PROXIED = frozenset(
    {
        ChaosFault.LOST_RUN_REPLY,
        ChaosFault.LOST_CONTROL_REPLY,
        ChaosFault.PARTITION,
        ChaosFault.SLOW_PREPARE,
    }
)
"""Faults applied by a fault proxy in front of one participant's URL."""
SIGNALLED = frozenset(
    {
        ChaosFault.REPLICA_KILL,
        ChaosFault.REPLICA_STOP,
        ChaosFault.PARTICIPANT_RESTART,
        ChaosFault.CHECKPOINT_KILL,
    }
)
"""Faults the trial process signals its own runtime's server processes with."""
SPEC_FAULTS = frozenset({ChaosFault.PEER_PARTITION, ChaosFault.CLOCK_SKEW})
"""Faults set up in a server's spec as the runtime starts it."""
OWN_SERVERS = SIGNALLED | SPEC_FAULTS
"""Faults that need the trial's servers to be its own processes (not ``rollpoint serve``'s):
signalled, or set up in their specs as they start."""
PEER_PATHS = {ParticipantKind.MODEL: "/v1/", ParticipantKind.RESOURCES: "/tools/"}
"""What a ``peer_partition`` is cut on: a policy call, or a tool call (a side effect)."""
CLOCK_SKEW_S = 2.0
"""How far a ``clock_skew`` moves a participant's clock, either way: within the
tolerance docs/protocol.md states (well under ``snapshot.deadline_seconds``)."""
RESTART_DOWN_S = (0.0, 3.0)
"""How long a ``participant_restart``'s server is gone before it starts again (then its
own start-up, about a second)."""
STORE_FULL_S = (0.2, 0.8)
"""How long a ``store_full`` lasts."""
STOP_S = (0.2, 2.5)
"""How long a ``replica_stop`` lasts: from shorter than a lease to past a save's deadline."""
LOST_REPLY_VERBS = (
    Verb.PREPARE,
    Verb.RENEW,
    Verb.COMMIT,
    Verb.CONFIRM,
    Verb.RESUME,
    Verb.RETIRE,
    Verb.FORGET,
    Verb.ACK,
)
"""The verbs a ``lost_control_reply`` may lose at any moment, each sent by the run's
trainer (``ack`` to agents only); a rerun may lose a ``restore`` reply too (its first call,
struck whatever the moment)."""


class PlannedFault(StrictModel):
    kind: ChaosFault
    run: Annotated[int, Field(ge=0, le=MAX_RERUNS)]
    """Which run of the trial suffers it: 0 the first, 1 the first rerun, ..."""
    at_s: Annotated[float, Field(ge=0)]
    """Seconds after that run's servers are up (or after ``after_snapshots``)."""
    after_snapshots: Annotated[int, Field(ge=0)] = 0
    """When not 0, ``at_s`` counts from the moment that run has published this many
    snapshots that saved episodes in flight: a fault that needs saved state to act on (a
    kill whose rerun continues saved episodes, a damage that needs a snapshot before the
    newest) gets it however slow the machine is, instead of hoping a fixed moment comes
    after it."""
    replica: Annotated[int, Field(ge=0)] = 0
    participant: ParticipantKind = ParticipantKind.AGENT
    """Proxied faults: whose URL the proxy stands in front of; ``peer_partition``: which
    of the agent's peers it cuts the agent from."""
    servers: list[ParticipantKind] = Field(default_factory=list)
    """``replica_kill``, ``replica_stop``: which of the replica's servers are signalled;
    ``participant_restart``: the one restarted."""
    verb: Verb | None = None
    """``lost_control_reply``: the verb whose reply is lost."""
    seconds: Annotated[float, Field(allow_inf_nan=False)] = 0.0
    """``partition``, ``peer_partition``, ``replica_stop``, ``store_full``: how long it
    lasts; ``participant_restart``: how long the server is gone; ``slow_prepare``: how late the prepare arrives; ``clock_skew``: how far ahead
    (negative: behind) the participant's clock runs."""
    forward: bool = False
    """``partition``, ``peer_partition``: the participant gets the request that starts it
    (its reply is lost)."""
    damage: Damage | None = None
    """``snapshot_tamper``: how the newest snapshot is damaged."""
    how: Literal["deleted", "replaced", "flip", "truncate", "delete"] | TokenDataHow | None = None
    """``lock_tamper``: what became of the lock file; ``pack_damage``: what was done to
    the shared records file (``pack_damage_live`` always flips a byte); ``bad_token_data``:
    which value is bad (:data:`rollpoint.protocol.engine_faults.BAD_VALUES`)."""
    call: Annotated[int, Field(ge=0)] = 0
    """Engine-data faults: which of the run's policy calls of its kind the scripted policy
    corrupts (1: the first; ``at_s`` is unused)."""
    error: Literal["ENOSPC", "EIO"] | None = None
    """``store_full``: what the failed writes raise."""

    @model_validator(mode="after")
    def _durations_are_not_negative(self) -> PlannedFault:
        if self.seconds < 0 and self.kind is not ChaosFault.CLOCK_SKEW:
            raise ValueError(f"{self.kind}: seconds must be >= 0, got {self.seconds}")
        return self

    def describe(self) -> str:
        where = f"replica-{self.replica}"
        if self.kind in PROXIED or self.kind is ChaosFault.CLOCK_SKEW:
            where = f"{self.participant}@{where}"
        elif self.kind is ChaosFault.PEER_PARTITION:
            where = f"agent-{self.participant} link@{where}"
        extra = {
            ChaosFault.REPLICA_KILL: f" ({', '.join(self.servers)})",
            ChaosFault.CHECKPOINT_KILL: f" ({', '.join(self.servers)}) at a save's capture",
            ChaosFault.PARTICIPANT_RESTART: f" ({', '.join(self.servers)}, down {self.seconds:.2f}s)",
            ChaosFault.REPLICA_STOP: f" ({', '.join(self.servers)}, {self.seconds:.2f}s)",
            ChaosFault.LOST_CONTROL_REPLY: f" ({self.verb})",
            ChaosFault.PARTITION: f" ({self.seconds:.2f}s{', forwarded' if self.forward else ''})",
            ChaosFault.PEER_PARTITION: f" ({self.seconds:.2f}s{', forwarded' if self.forward else ''})",
            ChaosFault.SLOW_PREPARE: f" (+{self.seconds:.2f}s)",
            ChaosFault.STORE_FULL: f" ({self.error}, {self.seconds:.2f}s)",
            ChaosFault.CLOCK_SKEW: f" ({self.seconds:+.2f}s)",
        }.get(self.kind, "")
        at = f"{self.at_s:.2f}s" + (
            f" after {self.after_snapshots} snapshots with episodes" if self.after_snapshots else ""
        )
        if self.kind is ChaosFault.SECOND_RUN:
            return f"{self.kind} on the workdir at {at} of run {self.run}"
        if self.kind is ChaosFault.SNAPSHOT_TAMPER:
            return f"{self.kind} of the newest snapshot ({self.damage}) before run {self.run}"
        if self.kind is ChaosFault.PACK_DAMAGE:
            return f"{self.kind} of the most shared records file ({self.how}) before run {self.run}"
        if self.kind in JOURNAL_DAMAGES:
            return f"{self.kind} of a {self.participant} journal before run {self.run}"
        if self.kind is ChaosFault.LOCK_TAMPER:
            return (
                f"{self.kind} (lock file {self.how}, then a second run) at {at} of run {self.run}"
            )
        if self.kind is ChaosFault.SECOND_JOB:
            return f"{self.kind} on the snapshot store at {at} of run {self.run}"
        if self.kind is ChaosFault.PACK_DAMAGE_LIVE:
            return f"{self.kind} of the most shared records file at {at} of run {self.run}"
        if self.kind in ENGINE_DATA:
            how = f" ({self.how})" if self.how else ""
            return f"{self.kind}{how} on policy call {self.call} of its kind in run {self.run}"
        if self.kind is ChaosFault.PROCESS_KILL:
            where = "trial"
        elif self.kind is ChaosFault.JOURNAL_COMMIT_KILL:
            where = "trial in a journal commit"
        elif self.kind is ChaosFault.STORE_FULL:
            where = "the snapshot store"
        elif self.kind is ChaosFault.TRAINER_KILL:
            where = "trainer"
        return f"{self.kind} of {where}{extra} at {at} of run {self.run}"


class TrialPlan(StrictModel):
    """One run of one trial: what ``python -m rollpoint.app.chaos.trial`` is given."""

    trial: Annotated[int, Field(ge=0)]
    config: Path
    """The job's config; the trial overrides its workdir, snapshot store and ports."""
    workdir: Path
    run: Annotated[int, Field(ge=0, le=MAX_RERUNS)] = 0
    """0 starts the job fresh; a rerun resumes from the trial's snapshots."""
    faults: list[PlannedFault] = Field(default_factory=list)
    """Every fault of the trial, of every run."""
    served: Path | None = None
    """The deployment ``rollpoint serve --json`` printed, when the trial's servers run
    apart from the trainer (set by the runner for a trial with a trainer kill)."""
    store_of: Path | None = None
    """A ``second_job``'s plan: the workdir of the trial whose snapshot store it names
    (None: its own)."""

    @property
    def servers_apart(self) -> bool:
        """The trial's servers outlive its trainer: it plans a trainer kill."""
        return any(f.kind is ChaosFault.TRAINER_KILL for f in self.faults)

    def in_process(self) -> list[PlannedFault]:
        """The faults this run's trial process applies itself."""
        return [f for f in self.faults if f.run == self.run and f.kind in IN_PROCESS]

    def kills(self) -> list[PlannedFault]:
        """The runner's kill of this run (at most one)."""
        return [f for f in self.faults if f.run == self.run and f.kind in KILLS]

    def second_runs(self) -> list[PlannedFault]:
        """The runner's second runs beside this one."""
        return [f for f in self.faults if f.run == self.run and f.kind in RUNNER_DURING]

    def before_run(self) -> list[PlannedFault]:
        """The runner's faults on the trial's folder before this run starts."""
        return [f for f in self.faults if f.run == self.run and f.kind in BETWEEN_RUNS]


def trial_store_folder(plan: TrialPlan) -> Path:
    """The local folder of a trial's snapshot store: its own ``snapshots`` folder (a second
    job's: the trial's it was started on)."""
    return (plan.store_of or plan.workdir) / "snapshots"


def trial_store(plan: TrialPlan) -> str:
    """The ``snapshot.store`` of a trial's runs and of its servers apart (named alike by
    both): its own folder, through the fault-injecting ``faultyfile://`` protocol when the
    plan fills the disk (:mod:`rollpoint.testing.faulty_store`)."""
    folder = trial_store_folder(plan)
    if any(f.kind is ChaosFault.STORE_FULL for f in plan.faults):
        return store_url(folder)
    return str(folder)


def engine_fault_log(plan: TrialPlan) -> Path:
    """Where the scripted policy of a trial's run logs each corruption it made (its
    ``policy.fault_log``): one file per run, so a run's strikes are its own."""
    return plan.workdir / f"engine-faults-run{plan.run}.jsonl"


def final_states_dir(plan: TrialPlan) -> Path:
    """Where a trial's resources servers log every verified episode's final state (the
    run's ``final_states_log``), whoever starts them: I2 is counted from it."""
    return plan.workdir / "final-states"


class TrialEvent(StrictModel):
    """One line a trial process prints on stdout."""

    event: Literal["up", "fault", "over", "missed", "resumed", "finished", "error"]
    """``fault``: a planned fault took effect; ``over``: it ended (a partition healed, a
    killed replica is back up); ``missed``: it did not take effect, ``reason`` says why;
    ``finished``/``error``: the run's last line."""
    ts: float
    """Unix time it happened."""
    kind: ChaosFault | None = None
    """``fault`` and ``over``: which kind of fault."""
    detail: str = ""
    """``fault``, ``over``, ``missed``: the fault as :meth:`PlannedFault.describe` says it."""
    reason: str = ""
    """``missed``: why it did not take effect; a runner's fault on the trial's folder
    (``fault``): what it did."""
    snapshot_id: str | None = None
    continued: int = 0
    """``resumed``: episodes continued from the snapshot."""
    restarted: int = 0
    """``resumed``: episodes the snapshot could not continue, started over."""
