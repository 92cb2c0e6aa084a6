"""The bad requests of the conformance kit's wire cases, and how they are sent.

Owns what the ``auth``, ``auth-before-parse``, ``malformed``, ``strict-wire`` and ``path``
cases of :mod:`rollpoint.testing.conformance_cases` send: the bad authorizations
(:data:`BAD_AUTH`, sent by :func:`all_unauthorized`, which also checks no 401 echoes the
token), the malformed, coerced and undecodable bodies with what each refusal must name or
say, and the checkpoint dirs that escape the snapshot root. Written against the protocol
reference (docs/protocol.md): each entry is a request the protocol says to refuse.

The cases themselves, and their order, stay in :mod:`rollpoint.testing.conformance_cases`.
"""

from __future__ import annotations

from typing import Any

from rollpoint.protocol.control import Verb
from rollpoint.testing.conformance_probe import CaseFailed, Trial, check, expect_refused

__all__ = [
    "BAD_AUTH",
    "COERCED",
    "ESCAPES",
    "MALFORMED",
    "UNDECODABLE",
    "all_unauthorized",
    "fill",
]

BAD_AUTH = {
    "no header": None,
    "a wrong token": "Bearer {token}-wrong",
    "another scheme": "Basic {token}",
}


async def all_unauthorized(t: Trial, requests: list[tuple[Verb, Any]]) -> None:
    """Each request, sent with each bad authorization: 401, no echo of the token, no change."""
    probe = t.probe
    # A short token may occur in any message by chance ("tok" in "token"): only a long
    # one, and the wrong one the kit made up, tell an echo apart.
    secrets = [f"{probe.token}-wrong"] + ([probe.token] if len(probe.token) >= 12 else [])
    before = await probe.status()
    for label, template in BAD_AUTH.items():
        authorization = None if template is None else template.format(token=probe.token)
        for verb, body in requests:
            reply = await probe.send(verb, body, authorization=authorization)
            try:
                expect_refused(reply, 401, "unauthorized")
            except CaseFailed as exc:
                raise CaseFailed(f"with {label}: {exc}") from None
            echoed = any(secret in reply.text for secret in secrets)
            check(not echoed, f"{verb} with {label}: the 401 echoes the token")
    await t.unchanged(before, "requests with a bad token")


_ANY_PREPARE = {"checkpoint_id": "@", "deadline_ts": 4e9}
_NEGATIVE_ATTEMPT = {"rollout_id": "@", "attempt": -1}
MALFORMED: list[tuple[str, Verb, Any, str | None]] = [
    # (what, verb, body, the field the 400 must name); "@" stands for a checkpoint id.
    ("a missing field", Verb.PREPARE, {"deadline_ts": 4e9}, "checkpoint_id"),
    ("a wrong type", Verb.PREPARE, {"checkpoint_id": "@", "deadline_ts": "soon"}, "deadline_ts"),
    ("an unknown field", Verb.PREPARE, {**_ANY_PREPARE, "surprise": 1}, "surprise"),
    ("a bad identifier", Verb.PREPARE, {**_ANY_PREPARE, "checkpoint_id": "a b"}, "checkpoint_id"),
    ("a zero deadline", Verb.PREPARE, {**_ANY_PREPARE, "deadline_ts": 0}, "deadline_ts"),
    ("a negative attempt", Verb.ACK, {"episode_ids": [_NEGATIVE_ATTEMPT]}, "episode_ids"),
    ("an empty list", Verb.FORGET, {"rollout_ids": []}, "rollout_ids"),
    ("a body that is not an object", Verb.RESUME, ["@"], None),
]
_EPISODE = {"rollout_id": "r", "attempt": 0}
_ANY_COMMIT = {**_ANY_PREPARE, "checkpoint_dir": "strict", "episode_ids": []}
COERCED: list[tuple[str, Verb, Any, str]] = [
    # (what, verb, body, the field the 400 must name): the strict wire coerces nothing.
    (
        "a number as a string",
        Verb.PREPARE,
        {**_ANY_PREPARE, "deadline_ts": "4000000000"},
        "deadline_ts",
    ),
    ("a bool for a number", Verb.PREPARE, {**_ANY_PREPARE, "deadline_ts": True}, "deadline_ts"),
    ("an int as a string", Verb.ACK, {"episode_ids": [{**_EPISODE, "attempt": "1"}]}, "attempt"),
    ("a bool for an int", Verb.ACK, {"episode_ids": [{**_EPISODE, "attempt": True}]}, "attempt"),
    ("a float for an int", Verb.ACK, {"episode_ids": [{**_EPISODE, "attempt": 1.0}]}, "attempt"),
    ("a number for a string", Verb.PREPARE, {**_ANY_PREPARE, "checkpoint_id": 7}, "checkpoint_id"),
    (
        "a string for a bool",
        Verb.COMMIT,
        {**_ANY_COMMIT, "wait_for_write": "yes"},
        "wait_for_write",
    ),
    ("a number for a bool", Verb.COMMIT, {**_ANY_COMMIT, "wait_for_write": 1}, "wait_for_write"),
]
UNDECODABLE: list[tuple[str, bytes | None, str | None, int, str, str]] = [
    # (what, body (None: a valid prepare), content type, status, code, what the message says)
    (
        "a body that is not JSON",
        b"{not json",
        "application/json",
        400,
        "bad_request",
        "not valid JSON",
    ),
    (
        "a truncated body",
        b'{"checkpoint_id": "x", "dead',
        "application/json",
        400,
        "bad_request",
        "truncated",
    ),
    (
        "UTF-16 JSON",
        '{"checkpoint_id": "x"}'.encode("utf-16"),
        "application/json",
        400,
        "bad_request",
        "UTF-8",
    ),
    ("no content type", None, None, 415, "unsupported_media_type", "Content-Type"),
    ("a text/plain body", None, "text/plain", 415, "unsupported_media_type", "text/plain"),
    (
        "a latin-1 charset",
        None,
        "application/json; charset=latin-1",
        415,
        "unsupported_media_type",
        "UTF-8",
    ),
]


def fill(body: Any, cid: str) -> Any:
    """``body`` with every ``"@"`` placeholder replaced by ``cid``."""
    if isinstance(body, dict):
        return {k: fill(v, cid) for k, v in body.items()}
    if isinstance(body, list):
        return [fill(v, cid) for v in body]
    return cid if body == "@" else body


ESCAPES = ["../x", "/abs", "a/../../x", "a/../b", "a\\b", "file:///tmp/x", "a/\x00b", "./"]
