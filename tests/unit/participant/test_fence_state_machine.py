"""Random, out-of-order and duplicate control verbs against one fence; invariants hold.

Time is a fake clock: a prepare that is not ready advances it to its deadline, and a
rule moves it forward so leases lapse. Hooks fail on demand.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from rollpoint.participant.control_settings import ControlSettings
from rollpoint.participant.fence import Fence
from rollpoint.protocol.control import (
    AckRequest,
    CommitReply,
    CommitRequest,
    ForgetRequest,
    Phase,
    PrepareRequest,
    RenewRequest,
    RestoreRequest,
    ResumeRequest,
    RetireRequest,
)
from rollpoint.protocol.errors import ProtocolError, RollpointError, StaleCheckpointError
from rollpoint.protocol.ids import EpisodeId
from tests.unit.participant.fake_participant import FakeClock, FakeParticipant

IDS = st.sampled_from([f"c{i}" for i in range(16)])
DIRS = st.sampled_from(["own", "own", "d0"])
"""``own``: the folder named after the checkpoint (or, for a restore, the one it committed to)."""
WHO = st.sampled_from(["active", "active", "active", "any"])
KEYS = ["r1#0", "r2#0", "r3#0"]
SCOPES = st.lists(st.sampled_from(KEYS), max_size=3)
LATE = st.sampled_from([False, False, False, True])
FAILING = st.sampled_from(["close_admission", "export", "install"])
MUTATING_HOOKS = ("close_admission", "open_admission", "install", "retire", "forget", "ack")


class FenceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.root = tempfile.mkdtemp(prefix="fence-sm-")
        self.clock = FakeClock()
        self.participant = FakeParticipant(clock=self.clock)
        self.participant.state = {"r1#0": 2, "r2#0": 1}
        self.participant.finished_unacked = [EpisodeId.from_key("r4#0")]
        settings_ = ControlSettings(token="t", snapshot_root=self.root, lease_grace_s=2.0)
        self.fence = Fence(self.participant, settings_, clock=self.clock)
        self.exports: Counter[str] = Counter()
        self.commits: dict[str, CommitReply] = {}
        self.stale: set[str] = set()
        self.saved = {"base": self._save_base()}
        """Checkpoint id → folder holding its committed state, for restores."""
        self._count_exports()

    def _save_base(self) -> str:
        """Commit a snapshot from another participant of the same identity, to restore."""
        other = FakeParticipant(clock=self.clock)
        other.state = {"r1#0": 5, "r3#0": 2}
        fence = Fence(other, ControlSettings(token="t", snapshot_root=self.root), clock=self.clock)
        deadline = self.clock() + 5
        commit = CommitRequest(
            checkpoint_id="base",
            deadline_ts=deadline,
            checkpoint_dir="snap-base",
            episode_ids=[EpisodeId.from_key("r1#0"), EpisodeId.from_key("r3#0")],
        )

        async def save() -> None:
            await fence.prepare(PrepareRequest(checkpoint_id="base", deadline_ts=deadline))
            await fence.commit(commit)
            await fence.aclose()

        self.loop.run_until_complete(save())
        return "snap-base"

    def _count_exports(self) -> None:
        export = self.participant.export

        async def counted(scope: list[EpisodeId]) -> Any:
            active = self.fence.checkpoint_id
            records = await export(scope)
            assert active is not None
            self.exports[active] += 1
            return records

        self.participant.export = counted  # type: ignore[method-assign]

    def teardown(self) -> None:
        self.loop.run_until_complete(self.fence.aclose())
        self.loop.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # --- driving ------------------------------------------------------------------------

    def observable(self) -> tuple[Any, ...]:
        calls = {k: self.participant.calls[k] for k in MUTATING_HOOKS}
        f, p = self.fence, self.participant
        return (f.phase, f.checkpoint_id, f.lease_expires_at, f.retire_marks, p.admission_open,
                dict(p.state), list(p.finished_unacked), calls)  # fmt: skip

    def reap(self) -> None:
        """Let a lapsed lease expire first, so it is not mistaken for the next verb's doing."""
        active = self.fence.checkpoint_id
        if self.loop.run_until_complete(self.fence.expire_lease_if_lapsed()):
            assert active is not None
            self.stale.add(active)

    def call(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        """Run one verb; a refusal must change nothing. Returns None when it raised."""
        self.reap()
        before = self.observable()
        try:
            return self.loop.run_until_complete(make())
        except ProtocolError:
            assert self.observable() == before, "a refused call changed the fence"
        except RollpointError:
            pass  # a hook failed on purpose; the invariants below still hold
        return None

    def deadline(self, late: bool) -> float:
        return self.clock() + (-1.0 if late else 1.0)

    def expect_stale(self, cid: str, make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        self.reap()
        if cid not in self.stale:
            return self.call(make)
        try:
            self.loop.run_until_complete(make())
        except StaleCheckpointError:
            return None
        raise AssertionError(f"{cid} was resumed, yet a verb naming it was not refused as stale")

    def pick(self, who: str, cid: str) -> str:
        """The active checkpoint id for ``who == "active"`` (when there is one), else ``cid``."""
        return self.fence.checkpoint_id or cid if who == "active" else cid

    # --- rules --------------------------------------------------------------------------

    @rule(cid=IDS, ready=st.booleans(), late=LATE)
    def prepare(self, cid: str, ready: bool, late: bool) -> None:
        self.participant.set_blockers([] if ready else ["r1#0"])
        req = PrepareRequest(checkpoint_id=cid, deadline_ts=self.deadline(late))
        reply = self.expect_stale(cid, lambda: self.fence.prepare(req))
        if reply is not None:
            assert reply.phase is self.fence.phase
            assert (reply.phase is Phase.PREPARED) == reply.report.ready

    @rule(who=WHO, cid=IDS, late=LATE)
    def renew(self, who: str, cid: str, late: bool) -> None:
        cid = self.pick(who, cid)
        req = RenewRequest(checkpoint_id=cid, deadline_ts=self.deadline(late))
        self.expect_stale(cid, lambda: self.fence.renew(req))

    @rule(who=WHO, cid=IDS, directory=DIRS, scope=SCOPES, late=LATE)
    def commit(self, who: str, cid: str, directory: str, scope: list[str], late: bool) -> None:
        cid = self.pick(who, cid)
        req = CommitRequest(
            checkpoint_id=cid,
            deadline_ts=self.deadline(late),
            checkpoint_dir=f"snap-{cid}" if directory == "own" else directory,
            episode_ids=[EpisodeId.from_key(k) for k in scope],
        )
        reply = self.expect_stale(cid, lambda: self.fence.commit(req))
        if reply is not None:
            assert self.fence.phase is Phase.COMMITTED
            assert self.commits.setdefault(cid, reply) == reply, "a replay gave another result"
            self.saved[cid] = reply.checkpoint_dir

    @rule(who=WHO, cid=IDS)
    def resume(self, who: str, cid: str) -> None:
        cid = self.pick(who, cid)
        reply = self.call(lambda: self.fence.resume(ResumeRequest(checkpoint_id=cid)))
        if reply is not None:
            assert reply.phase is self.fence.phase
            assert reply.idempotent or reply.phase is Phase.IDLE
            self.stale.add(cid)

    @rule(data=st.data(), who=WHO, cid=IDS, directory=DIRS, scope=SCOPES, late=LATE)
    def restore(
        self, data: st.DataObject, who: str, cid: str, directory: str, scope: list[str], late: bool
    ) -> None:
        cid = self.pick(who, cid)
        source = data.draw(st.sampled_from(sorted(self.saved)))
        if directory == "own":
            directory = self.saved[source]
        req = RestoreRequest(
            checkpoint_id=cid,
            deadline_ts=self.deadline(late),
            checkpoint_dir=directory,
            episode_ids=[EpisodeId.from_key(k) for k in scope],
            source_checkpoint_id=source,
        )
        reply = self.expect_stale(cid, lambda: self.fence.restore(req))
        if reply is not None:
            assert self.fence.phase is Phase.RESTORED

    @rule(verb=st.sampled_from(["retire", "forget", "ack"]), key=st.sampled_from(KEYS))
    def bookkeeping(self, verb: str, key: str) -> None:
        episode = EpisodeId.from_key(key)
        if verb == "retire":
            retire = RetireRequest(episode_ids=[episode])
            self.call(lambda: self.fence.retire(retire))
        elif verb == "forget":
            forget = ForgetRequest(rollout_ids=[episode.rollout_id])
            self.call(lambda: self.fence.forget(forget))
        else:
            ack = AckRequest(episode_ids=[EpisodeId.from_key("r4#0")])
            self.call(lambda: self.fence.ack(ack))

    @rule(
        change=st.sampled_from(["time", "restart", "no restarts", "break", "repair"]),
        seconds=st.sampled_from([0.5, 2.0, 5.0]),
        key=st.sampled_from(KEYS),
        hook=FAILING,
    )
    def world_changes(self, change: str, seconds: float, key: str, hook: str) -> None:
        """Time passes, an episode becomes a restart, or a hook starts or stops failing."""
        if change == "time":
            self.clock.advance(seconds)
        elif change == "restart":
            self.participant.restarts = [EpisodeId.from_key(key)]
        elif change == "no restarts":
            self.participant.restarts = []
        elif change == "break":
            self.participant.fail = {hook}
        else:
            self.participant.fail = set()

    # --- invariants ---------------------------------------------------------------------

    @invariant()
    def admission_open_iff_idle(self) -> None:
        idle = self.fence.phase is Phase.IDLE
        assert self.participant.admission_open == idle
        calls = self.participant.calls
        assert calls["close_admission"] - calls["open_admission"] == (0 if idle else 1)

    @invariant()
    def lease_and_id_held_iff_not_idle(self) -> None:
        idle = self.fence.phase is Phase.IDLE
        assert (self.fence.lease_expires_at is None) == idle
        assert (self.fence.checkpoint_id is None) == idle

    @invariant()
    def each_checkpoint_exported_at_most_once(self) -> None:
        assert all(n <= 1 for n in self.exports.values()), self.exports


FenceMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, derandomize=True
)
TestFenceStateMachine = FenceMachine.TestCase
