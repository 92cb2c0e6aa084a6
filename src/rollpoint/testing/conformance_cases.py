"""The cases of the participant conformance kit, in the order they run.

Owns what each case sends and what it expects back, written against the protocol
reference (docs/protocol.md), never against rollpoint's own implementation. A case is an
async function of a :class:`~rollpoint.testing.conformance_probe.Trial` that returns a
one-line detail, or raises :class:`~rollpoint.testing.conformance_probe.CaseFailed` with
one; :func:`case` registers it in :data:`CASES` under a name that also goes into its
checkpoint ids (so: letters, digits and ``-``). The bad requests the wire cases send are
in :mod:`~rollpoint.testing.conformance_requests`, the look at what a commit wrote on disk in
:mod:`~rollpoint.testing.conformance_on_disk`.

It does not run, time or clean up after the cases (:mod:`rollpoint.testing.conformance`
does). A case may leave the participant held: every id it took from ``Trial.cid`` is
resumed after it, and every rollout from ``Trial.rollout`` forgotten.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from rollpoint.protocol.control import (
    DETACHED_WRITE,
    PROTOCOL_VERSION,
    SCOPE_KEYS,
    AckReply,
    CommitReply,
    ConfirmReply,
    ForgetReply,
    Phase,
    PrepareReply,
    RenewReply,
    RestoreReply,
    ResumeReply,
    RetireReply,
    StatusReply,
    Verb,
)
from rollpoint.testing.conformance_on_disk import manifest_on_disk, written
from rollpoint.testing.conformance_probe import (
    DEADLINE_S,
    CaseFailed,
    Trial,
    check,
    deadline,
    expect_ok,
)
from rollpoint.testing.conformance_requests import (
    COERCED,
    ESCAPES,
    MALFORMED,
    UNDECODABLE,
    all_unauthorized,
    fill,
)

LEASE_DEADLINE_S = 1.0
"""The lease case's prepare deadline: close, so the lease lapses quickly."""
ASSUMED_GRACE_S = 10.0
"""The lease grace assumed without a hint (the protocol suggests about 2 s)."""
LEASE_MARGIN_S = 2.0
"""Slack for a participant that checks its lease on a timer rather than exactly."""
_POLL_S = 0.05


Case = Callable[[Trial], Awaitable[str]]
CASES: list[tuple[str, Case]] = []


def case(name: str) -> Callable[[Case], Case]:
    """Register a case under ``name`` (an identifier fragment: it goes into checkpoint ids)."""

    def register(fn: Case) -> Case:
        CASES.append((name, fn))
        return fn

    return register


def _ids(cid: str, due: float | None = None) -> dict[str, Any]:
    return {"checkpoint_id": cid, "deadline_ts": deadline() if due is None else due}


# --- the cases ----------------------------------------------------------------------------


@case("status")
async def _status(t: Trial) -> str:
    s = await t.probe.status()
    check(
        s.protocol_version == PROTOCOL_VERSION,
        f"protocol_version is {s.protocol_version}, this kit speaks {PROTOCOL_VERSION}",
    )
    check(
        (s.phase, s.checkpoint_id, s.lease_expires_at) == (Phase.IDLE, None, None),
        f"not idle (phase {s.phase}, checkpoint {s.checkpoint_id}, lease {s.lease_expires_at}): "
        "run the kit against a quiet participant no coordinator talks to",
    )
    features = ", ".join(s.features) or "none"
    return f"{s.kind} {s.name}/{s.replica}, mode {s.mode}, features: {features}"


@case("prepare")
async def _prepare(t: Trial) -> str:
    cid, started = t.cid(), time.monotonic()
    reply = await t.prepare(cid)
    status = await t.phase_is(Phase.PREPARED, cid)
    check(
        status.lease_expires_at == reply.lease_expires_at,
        f"status lease {status.lease_expires_at} differs from prepare's {reply.lease_expires_at}",
    )
    return f"prepared in {time.monotonic() - started:.3f}s; status agrees"


@case("prepare-replay")
async def _prepare_replay(t: Trial) -> str:
    cid, due = t.cid(), deadline()
    first = await t.prepare(cid, due)
    again = await t.probe.send(Verb.PREPARE, _ids(cid, due))
    expect_ok(again, PrepareReply)
    check(again.body == first.model_dump(mode="json"), "a replayed prepare got another reply")
    await t.phase_is(Phase.PREPARED, cid)
    return "a replay while prepared returns the recorded reply"


@case("renew")
async def _renew(t: Trial) -> str:
    cid = t.cid()
    await t.prepare(cid)
    later = deadline(2 * DEADLINE_S)
    renewed = expect_ok(await t.probe.send(Verb.RENEW, _ids(cid, later)), RenewReply)
    check(
        (renewed.phase, renewed.checkpoint_id) == (Phase.PREPARED, cid),
        f"renew: reply says phase {renewed.phase} checkpoint {renewed.checkpoint_id}",
    )
    check(renewed.lease_expires_at >= later, "renew: the lease ends before the new deadline")
    shorter = expect_ok(await t.probe.send(Verb.RENEW, _ids(cid)), RenewReply)
    check(
        shorter.lease_expires_at == renewed.lease_expires_at,
        f"renew with an earlier deadline moved the lease from {renewed.lease_expires_at} "
        f"to {shorter.lease_expires_at}; a lease never shrinks",
    )
    await t.phase_is(Phase.PREPARED, cid)
    return "renew extends the lease, an earlier deadline never shrinks it"


@case("deadline")
async def _deadline(t: Trial) -> str:
    cid, past = t.cid(), time.time() - 1.0
    await t.refused(Verb.PREPARE, _ids(cid, past), 409, "deadline_exceeded")
    await t.prepare(cid)
    await t.refused(Verb.RENEW, _ids(cid, past), 409, "deadline_exceeded")
    return "a passed deadline is refused (prepare, renew) and changes nothing"


@case("commit")
async def _commit(t: Trial) -> str:
    cid, folder = t.cid(), t.folder()
    status = await t.probe.status()
    await t.prepare(cid)
    reply = expect_ok(await t.commit(cid, folder, []), CommitReply)
    instance = f"{status.name}-{status.replica}"
    m = written(reply, "commit")
    expected: list[tuple[str, object, object]] = [
        ("phase", reply.phase, Phase.COMMITTED),
        ("checkpoint_id", reply.checkpoint_id, cid),
        ("checkpoint_dir", reply.checkpoint_dir, folder),
        ("state_dir", reply.state_dir, f"{status.kind}/{instance}"),
        ("scope_size", reply.scope_size, 0),
        ("manifest.checkpoint_id", m.checkpoint_id, cid),
        ("manifest.kind", m.kind, status.kind),
        ("manifest.instance", m.instance, instance),
        ("manifest.count", m.count, sum(p.count for p in m.parts)),
    ]
    wrong = [f"{name} {got!r} (expected {want!r})" for name, got, want in expected if got != want]
    check(not wrong, f"commit reply: {'; '.join(wrong)}")
    await t.phase_is(Phase.COMMITTED, cid)
    on_disk = await manifest_on_disk(t.local_root, reply, m) if t.local_root else ""
    return f"committed {len(m.parts)} part(s), {m.count} record(s){on_disk}"


@case("detached-write")
async def _detached_write(t: Trial) -> str:
    status = await t.probe.status()
    if DETACHED_WRITE not in status.features:
        return f"not listed in features ({DETACHED_WRITE}): commits always wait for the write"
    cid, folder = t.cid(), t.folder()
    await t.prepare(cid)
    body = {**_ids(cid), "checkpoint_dir": folder, "episode_ids": [], "wait_for_write": False}
    reply = expect_ok(await t.probe.send(Verb.COMMIT, body), CommitReply)
    check(reply.phase is Phase.COMMITTED, f"detached commit: phase {reply.phase}")
    expect_ok(await t.probe.send(Verb.RESUME, {"checkpoint_id": cid}), ResumeReply)
    await t.phase_is(Phase.IDLE, None)
    confirmed = expect_ok(await t.probe.send(Verb.CONFIRM, _ids(cid)), ConfirmReply)
    m = confirmed.manifest
    check(
        (confirmed.checkpoint_id, m.checkpoint_id) == (cid, cid),
        f"confirm: reply names {confirmed.checkpoint_id}, manifest {m.checkpoint_id}",
    )
    again = expect_ok(await t.probe.send(Verb.CONFIRM, _ids(cid)), ConfirmReply)
    check(again == confirmed, "a second confirm got another manifest")
    await t.refused(Verb.CONFIRM, _ids(t.cid("never")), 404, "not_found")
    on_disk = await manifest_on_disk(t.local_root, reply, m) if t.local_root else ""
    return f"replied before the write; confirm after resume returned {m.count} record(s){on_disk}"


@case("scope-keys")
async def _scope_keys(t: Trial) -> str:
    status = await t.probe.status()
    if SCOPE_KEYS not in status.features:
        return f"not listed in features ({SCOPE_KEYS}): the scope is sent as episode_ids"
    cid, folder = t.cid(), t.folder()
    await t.prepare(cid)
    # Episodes this participant never saw: named, not held, so nothing to save for them.
    keys = ["conformance-unknown#0", "conformance-unknown#1", "conformance-unknown#0"]
    body = {**_ids(cid), "checkpoint_dir": folder, "episode_keys": keys}
    reply = expect_ok(await t.probe.send(Verb.COMMIT, body), CommitReply)
    check(reply.scope_size == 2, f"keys commit: scope_size {reply.scope_size}, want 2")
    ids = [{"rollout_id": "conformance-unknown", "attempt": a} for a in (1, 0)]
    again = expect_ok(await t.commit(cid, folder, ids), CommitReply)
    check(again == reply, "the same scope named by ids got another reply than by keys")
    expect_ok(await t.probe.send(Verb.RESUME, {"checkpoint_id": cid}), ResumeReply)
    return "a scope named by keys is the same commit as by ids"


@case("commit-replay")
async def _commit_replay(t: Trial) -> str:
    cid, folder = t.cid(), t.folder()
    await t.prepare(cid)
    first = expect_ok(await t.commit(cid, folder, []), CommitReply)
    again = await t.commit(cid, folder, [])
    expect_ok(again, CommitReply)
    check(again.body == first.model_dump(mode="json"), "a replayed commit got another reply")
    late = {**_ids(cid, time.time() - 1.0), "checkpoint_dir": folder, "episode_ids": []}
    collected = await t.probe.send(Verb.COMMIT, late)
    expect_ok(collected, CommitReply)
    check(
        collected.body == again.body,
        "a replayed commit with a passed deadline got another reply; it must collect the write",
    )
    await t.phase_is(Phase.COMMITTED, cid)
    return "a replay (even past its deadline) returns the same reply"


@case("commit-conflict")
async def _commit_conflict(t: Trial) -> str:
    cid, folder = t.cid(), t.folder()
    await t.prepare(cid)
    expect_ok(await t.commit(cid, folder, []), CommitReply)
    other_dir = {**_ids(cid), "checkpoint_dir": t.folder("other"), "episode_ids": []}
    await t.refused(Verb.COMMIT, other_dir, 409, "checkpoint_conflict")
    scope = [{"rollout_id": t.rollout(), "attempt": 0}]
    other_scope = {**_ids(cid), "checkpoint_dir": folder, "episode_ids": scope}
    await t.refused(Verb.COMMIT, other_scope, 409, "checkpoint_conflict")
    return "a retry naming another dir or scope is checkpoint_conflict"


@case("resume")
async def _resume(t: Trial) -> str:
    cid = t.cid()
    await t.prepare(cid)
    reply = expect_ok(await t.probe.send(Verb.RESUME, {"checkpoint_id": cid}), ResumeReply)
    check(
        (reply.phase, reply.checkpoint_id, reply.idempotent) == (Phase.IDLE, cid, False),
        f"resume: reply {reply.model_dump(mode='json')}",
    )
    status = await t.phase_is(Phase.IDLE, None)
    check(status.lease_expires_at is None, "status: idle but a lease is still reported")
    return "prepared -> idle, lease gone"


@case("resume-replay")
async def _resume_replay(t: Trial) -> str:
    cid = t.cid()
    await t.prepare(cid)
    expect_ok(await t.probe.send(Verb.RESUME, {"checkpoint_id": cid}), ResumeReply)
    for what, target in (("a replayed", cid), ("an unknown", t.cid("unknown"))):
        reply = expect_ok(await t.probe.send(Verb.RESUME, {"checkpoint_id": target}), ResumeReply)
        check(
            (reply.phase, reply.idempotent) == (Phase.IDLE, True),
            f"{what} resume: phase {reply.phase}, idempotent {reply.idempotent}",
        )
    return "resuming again, or an unknown id in idle, is idempotent"


@case("stale")
async def _stale(t: Trial) -> str:
    cid = t.cid()
    await t.prepare(cid)
    expect_ok(await t.probe.send(Verb.RESUME, {"checkpoint_id": cid}), ResumeReply)
    await t.refused(Verb.PREPARE, _ids(cid), 409, "stale_checkpoint")
    await t.refused(Verb.RENEW, _ids(cid), 409, "stale_checkpoint")
    late_commit = {**_ids(cid), "checkpoint_dir": t.folder(), "episode_ids": []}
    await t.refused(Verb.COMMIT, late_commit, 409, "stale_checkpoint")
    return "a late prepare, renew or commit of a resumed id is stale_checkpoint"


@case("invalid-phase")
async def _invalid_phase(t: Trial) -> str:
    cid, folder = t.cid(), t.folder()
    await t.refused(
        Verb.COMMIT,
        {**_ids(cid), "checkpoint_dir": folder, "episode_ids": []},
        409,
        "invalid_phase",
    )
    await t.refused(Verb.RENEW, _ids(cid), 409, "invalid_phase")
    await t.prepare(cid)
    expect_ok(await t.commit(cid, folder, []), CommitReply)
    await t.refused(Verb.PREPARE, _ids(cid), 409, "invalid_phase")
    return "commit or renew in idle, prepare in committed: invalid_phase"


@case("conflict")
async def _conflict(t: Trial) -> str:
    active, other = t.cid(), t.cid("other")
    await t.prepare(active)
    await t.refused(Verb.PREPARE, _ids(other), 409, "checkpoint_conflict")
    await t.refused(Verb.RENEW, _ids(other), 409, "checkpoint_conflict")
    commit = {**_ids(other), "checkpoint_dir": t.folder(), "episode_ids": []}
    await t.refused(Verb.COMMIT, commit, 409, "checkpoint_conflict")
    await t.refused(Verb.RESUME, {"checkpoint_id": other}, 409, "checkpoint_conflict")
    return "prepare, renew, commit and resume of another id while prepared: checkpoint_conflict"


@case("auth")
async def _auth(t: Trial) -> str:
    cid = t.cid()
    requests: list[tuple[Verb, Any]] = [
        (Verb.STATUS, None),
        (Verb.PREPARE, _ids(cid)),
        (Verb.RESUME, {"surprise": True}),
    ]
    await all_unauthorized(t, requests)
    lowercase = await t.probe.send(Verb.STATUS, authorization=f"bearer {t.probe.token}")
    expect_ok(lowercase, StatusReply)
    await t.prepare(cid)
    return "no header, a wrong token or scheme: 401 before the body is validated; nothing changed"


@case("auth-before-parse")
async def _auth_before_parse(t: Trial) -> str:
    await all_unauthorized(t, [(Verb.PREPARE, b"{not json"), (Verb.RESUME, None)])
    return "a body that is not JSON (or null) with a bad token: 401, not 400"


@case("malformed")
async def _malformed(t: Trial) -> str:
    cid = t.cid()
    for what, verb, body, name in MALFORMED:
        try:
            message = await t.refused(verb, fill(body, cid), 400, "bad_request")
        except CaseFailed as exc:
            raise CaseFailed(f"{what}: {exc}") from None
        check(name is None or name in message, f"{what}: the 400 does not name {name!r}: {message}")
    await t.prepare(cid)
    bad_renew = {"checkpoint_id": cid, "deadline_ts": "later"}
    message = await t.refused(Verb.RENEW, bad_renew, 400, "bad_request")
    check(
        "deadline_ts" in message,
        f"a malformed renew: the 400 does not name 'deadline_ts': {message}",
    )
    return f"{len(MALFORMED) + 1} malformed bodies: 400 naming the field, nothing changed"


@case("strict-wire")
async def _strict_wire(t: Trial) -> str:
    cid = t.cid()
    for what, verb, body, name in COERCED:
        try:
            message = await t.refused(verb, fill(body, cid), 400, "bad_request")
        except CaseFailed as exc:
            raise CaseFailed(f"{what}: {exc}") from None
        check(name in message, f"{what}: the 400 does not name {name!r}: {message}")
    valid = orjson.dumps({"checkpoint_id": cid, "deadline_ts": deadline()})
    for what, raw, content_type, status, code, says in UNDECODABLE:
        body = valid if raw is None else raw
        try:
            message = await t.refused(Verb.PREPARE, body, status, code, content_type=content_type)
        except CaseFailed as exc:
            raise CaseFailed(f"{what}: {exc}") from None
        check(says in message, f"{what}: the {status} does not say {says!r}: {message}")
    far = {"checkpoint_id": cid, "deadline_ts": 1e12}
    message = await t.refused(Verb.PREPARE, far, 400, "bad_request")
    check("deadline_ts" in message, f"a deadline 1e12: the 400 does not name it: {message}")
    # JSON has one number type: an integer is a valid deadline.
    whole = {"checkpoint_id": cid, "deadline_ts": int(deadline())}
    expect_ok(await t.probe.send(Verb.PREPARE, whole), PrepareReply)
    return (
        f"{len(COERCED)} coerced fields: 400; {len(UNDECODABLE)} undecodable bodies: 400/415 "
        "saying why; a deadline past the horizon: 400; an integer deadline accepted"
    )


@case("path")
async def _path(t: Trial) -> str:
    cid = t.cid()
    for verb in (Verb.COMMIT, Verb.RESTORE):
        body = {**_ids(cid), "checkpoint_dir": "../x", "episode_ids": []}
        await t.refused(verb, body, 400, "bad_request")
    await t.prepare(cid)
    for escape in ESCAPES:
        body = {**_ids(cid), "checkpoint_dir": escape, "episode_ids": []}
        try:
            await t.refused(Verb.COMMIT, body, 400, "bad_request")
        except CaseFailed as exc:
            raise CaseFailed(f"checkpoint_dir {escape!r}: {exc}") from None
    expect_ok(await t.commit(cid, t.folder(), []), CommitReply)
    return f"{len(ESCAPES)} escaping dirs: 400, even before the phase check; nothing spent"


@case("lease")
async def _lease(t: Trial) -> str:
    cid = t.cid()
    grace = t.lease_grace_s_hint if t.lease_grace_s_hint is not None else ASSUMED_GRACE_S
    due = deadline(LEASE_DEADLINE_S)
    await t.prepare(cid, due)
    limit = due + grace + LEASE_MARGIN_S
    while (status := await t.probe.status()).phase is not Phase.IDLE:
        if time.time() > limit:
            raise CaseFailed(
                f"still {status.phase} {grace + LEASE_MARGIN_S:.1f}s after the deadline "
                f"(grace {grace:g}s + {LEASE_MARGIN_S:g}s margin): the lease never reopened it"
            )
        await asyncio.sleep(_POLL_S)
    reopened = time.time() - due
    check(status.checkpoint_id is None, "idle after the lease lapsed, but a checkpoint is active")
    await t.refused(Verb.PREPARE, _ids(cid), 409, "stale_checkpoint")
    resumed = expect_ok(await t.probe.send(Verb.RESUME, {"checkpoint_id": cid}), ResumeReply)
    check(resumed.idempotent, "resume after the lease lapsed is not idempotent")
    hint = "hint" if t.lease_grace_s_hint is not None else "assumed at most"
    return f"reopened {reopened:.2f}s after the deadline (grace {hint} {grace:g}s); id now stale"


@case("restore")
async def _restore(t: Trial) -> str:
    saved, restore, folder = t.cid(), t.cid("restore"), t.folder()
    await t.prepare(saved)
    expect_ok(await t.commit(saved, folder, []), CommitReply)
    expect_ok(await t.probe.send(Verb.RESUME, {"checkpoint_id": saved}), ResumeReply)
    wrong_source = {**_ids(restore), "checkpoint_dir": folder, "episode_ids": []}
    wrong_source["source_checkpoint_id"] = t.cid("never-saved")
    await t.refused(Verb.RESTORE, wrong_source, 422, "invalid_checkpoint_state")
    body = {
        **_ids(restore),
        "checkpoint_dir": folder,
        "episode_ids": [],
        "source_checkpoint_id": saved,
    }
    reply = expect_ok(await t.probe.send(Verb.RESTORE, body), RestoreReply)
    check(
        (reply.phase, reply.checkpoint_id, reply.source_checkpoint_id, reply.restored)
        == (Phase.RESTORED, restore, saved, []),
        f"restore reply: {reply.model_dump(mode='json')}",
    )
    again = await t.probe.send(Verb.RESTORE, body)
    check(again.body == reply.model_dump(mode="json"), "a replayed restore got another reply")
    await t.phase_is(Phase.RESTORED, restore)
    return "records of another checkpoint: 422; restore -> restored, a replay the same reply"


@case("retire")
async def _retire(t: Trial) -> str:
    rid, before = t.rollout(), await t.probe.status()
    body = {"episode_ids": [{"rollout_id": rid, "attempt": 2}, {"rollout_id": rid, "attempt": 0}]}
    reply = expect_ok(await t.probe.send(Verb.RETIRE, body), RetireReply)
    check(reply.marks == {rid: 2}, f"retire: marks {reply.marks}, expected {{{rid!r}: 2}}")
    lower = {"episode_ids": [{"rollout_id": rid, "attempt": 1}]}
    again = expect_ok(await t.probe.send(Verb.RETIRE, lower), RetireReply)
    check(again.marks == {rid: 2}, f"a lower retire moved the mark: {again.marks}; marks only rise")
    after = await t.probe.status()
    check(
        after.retired_rollouts == before.retired_rollouts + 1,
        f"status: retired_rollouts {before.retired_rollouts} -> {after.retired_rollouts}, "
        "expected one more",
    )
    cid = t.cid()
    await t.prepare(cid)
    await t.refused(Verb.RETIRE, lower, 409, "invalid_phase")
    return "marks rise to the highest attempt and never fall; refused while prepared"


@case("forget")
async def _forget(t: Trial) -> str:
    rid, before = t.rollout(), await t.probe.status()
    retire = {"episode_ids": [{"rollout_id": rid, "attempt": 0}]}
    expect_ok(await t.probe.send(Verb.RETIRE, retire), RetireReply)
    reply = expect_ok(await t.probe.send(Verb.FORGET, {"rollout_ids": [rid]}), ForgetReply)
    check(rid in reply.forgotten, f"forget: {rid} not in forgotten {reply.forgotten}")
    after = await t.probe.status()
    check(
        after.retired_rollouts == before.retired_rollouts,
        f"status: retired_rollouts {after.retired_rollouts} after forget, "
        f"expected {before.retired_rollouts}",
    )
    expect_ok(await t.probe.send(Verb.FORGET, {"rollout_ids": [rid]}), ForgetReply)
    cid = t.cid()
    await t.prepare(cid)
    await t.refused(Verb.FORGET, {"rollout_ids": [rid]}, 409, "invalid_phase")
    return "forget drops the mark, twice is a no-op; refused while prepared"


@case("ack")
async def _ack(t: Trial) -> str:
    episode = {"rollout_id": t.rollout(), "attempt": 0}
    body = {"episode_ids": [episode]}
    idle = expect_ok(await t.probe.send(Verb.ACK, body), AckReply)
    check(idle.acked == [], f"ack of an episode never run acked {idle.acked}")
    cid = t.cid()
    await t.prepare(cid)
    before = await t.probe.status()
    expect_ok(await t.probe.send(Verb.ACK, body), AckReply)
    await t.unchanged(before, "an ack while prepared")
    return "ack is legal in idle and prepared, and changes no phase"
