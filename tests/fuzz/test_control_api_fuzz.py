"""Fuzzing the control routes of live participants with schemathesis.

Requests are generated from each server's own OpenAPI schema (``/openapi.json``, cut
down to the control routes), valid ones and invalid ones, and sent over HTTP to a real
server that was first put in one of the phases a coordinator can leave it in (idle,
prepared, committed, restored); half of the generated bodies are aimed at the checkpoint
the server holds, so they get past the id checks. Two properties:

- no request gets a 5xx; a 2xx carries the verb's reply model, a 4xx the error envelope;
- a refused request (4xx) leaves the status as it was (phase, checkpoint id, lease,
  counts, retired rollouts), whatever the phase and whatever token it carried, and a
  request without the right token is never served.

Bounded and derandomized: the same examples every run. The tally of what was sent is
printed at the end of the run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode

from rollpoint.protocol.control import CONTROL_PREFIX, Verb
from tests.fuzz.control_fuzz import (
    AUTH,
    REPLIES,
    Start,
    Target,
    error_code,
    serve_target,
)

# One worker runs the file: each participant kind's module target is started once.
pytestmark = [pytest.mark.integration, pytest.mark.fuzz, pytest.mark.xdist_group("fuzz")]

KINDS = ["agent", "model", "resources"]
EXAMPLES = {"agent": 50, "model": 15, "resources": 15}
"""Per operation and mode: the agent in full, the other two lighter (same fence)."""
BAD_AUTH: dict[str, dict[str, str]] = {
    "no token": {},
    "a wrong token": {"authorization": "Bearer not-the-token"},
}


def bounded(max_examples: int) -> Any:
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        # Every example is a few HTTP calls: shrinking a failure could take minutes, and
        # the failing request is printed as generated.
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.data_too_large,
        ],
    )


@pytest.fixture(scope="module", params=KINDS)
def target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    kind: str = request.param
    root: Path = tmp_path_factory.mktemp(f"fuzz-{kind}")
    with serve_target(kind, root) as live:
        yield live


def modes(verb: Verb) -> list[GenerationMode]:
    # status takes no input: nothing of it can be made invalid.
    return [GenerationMode.POSITIVE] if verb is Verb.STATUS else list(GenerationMode)


def check_reply(verb: Verb, response: Any, case: Case) -> None:
    status, sent = response.status_code, f"(sent {case.body!r:.300})"
    assert status < 500, f"{verb}: {status} {response.text[:300]} {sent}"
    if status < 300:
        REPLIES[verb].model_validate(response.json())
    else:
        assert error_code(response.content) is not None, (
            f"{verb}: {status} without the error envelope: {response.text[:300]} {sent}"
        )


@pytest.mark.parametrize(
    ("verb", "mode"), [(v, m) for v in Verb for m in modes(v)], ids=lambda p: str(p)
)
def test_no_fuzzed_control_request_gets_a_5xx(
    target: Target, verb: Verb, mode: GenerationMode
) -> None:
    cases = target.operation(verb).as_strategy(mode)

    @bounded(EXAMPLES[target.kind])
    @given(case=cases, start=st.sampled_from(Start), aim=st.booleans())
    def fuzz(case: Case, start: Start, aim: bool) -> None:
        target.enter(start)
        try:
            if aim:
                target.aim(case)
            response = target.send(case, AUTH)
        finally:
            target.reset()
        check_reply(verb, response, case)

    fuzz()


@pytest.mark.parametrize("verb", list(Verb), ids=str)
def test_a_refused_control_request_changes_nothing(target: Target, verb: Verb) -> None:
    operation = target.operation(verb)
    cases = st.one_of(*(operation.as_strategy(m) for m in modes(verb)))
    tokens = st.sampled_from(["the token", *BAD_AUTH])

    @bounded(EXAMPLES[target.kind])
    @given(case=cases, start=st.sampled_from(Start), aim=st.booleans(), token=tokens)
    def refusal_changes_nothing(case: Case, start: Start, aim: bool, token: str) -> None:
        target.enter(start)
        try:
            if aim:
                target.aim(case)
            before = target.fingerprint()
            response = target.send(case, BAD_AUTH.get(token, AUTH))
            after = target.fingerprint()
        finally:
            target.reset()
        if token in BAD_AUTH:
            assert response.status_code >= 400, f"{verb} with {token} was served"
        if 400 <= response.status_code < 500:
            assert after == before, (
                f"{verb} refused with {response.status_code} changed status "
                f"{before} -> {after} (sent {case.body!r:.300})"
            )

    refusal_changes_nothing()


def _coercible(value: Any) -> bool:
    """Whether ``value`` holds a number or bool somewhere."""
    if isinstance(value, bool | int | float):
        return True
    if isinstance(value, dict):
        return any(_coercible(v) for v in value.values())
    return isinstance(value, list) and any(_coercible(v) for v in value)


def _coerced(value: Any, draw: Any) -> Any:
    """``value`` (a coercible JSON value) with one number or bool swapped for a form lax
    parsing would coerce back: a number or bool as its string, a bool as a number, an int
    as a float, a float as a bool."""
    if isinstance(value, bool):
        return draw(st.sampled_from([str(value).lower(), int(value)]))
    if isinstance(value, int | float):
        other = float(value) if isinstance(value, int) else True
        return draw(st.sampled_from([str(value), other]))
    if isinstance(value, dict):
        key = draw(st.sampled_from(sorted(k for k, v in value.items() if _coercible(v))))
        return {**value, key: _coerced(value[key], draw)}
    index = draw(st.sampled_from([i for i, v in enumerate(value) if _coercible(v)]))
    return [*value[:index], _coerced(value[index], draw), *value[index + 1 :]]


@st.composite
def _spoiled(draw: Any, body: Any) -> tuple[str, bytes, str | None]:
    """(what, bytes, content type) of a valid ``body`` made undecodable or coerced."""
    raw = orjson.dumps(body)
    kind = draw(st.sampled_from(["truncated", "utf-16", "content type", "coerced"]))
    if kind == "truncated":
        return kind, raw[: draw(st.integers(0, len(raw) - 1))], "application/json"
    if kind == "utf-16":
        return (
            kind,
            raw.decode().encode(draw(st.sampled_from(["utf-16", "utf-32"]))),
            "application/json",
        )
    if kind == "content type":
        types = [
            None,
            "text/plain",
            "application/x-www-form-urlencoded",
            "application/json; charset=latin-1",
        ]
        return kind, raw, draw(st.sampled_from(types))
    if not _coercible(body):  # nothing to coerce: send it truncated instead
        return "truncated", raw[:-1], "application/json"
    return kind, orjson.dumps(_coerced(body, draw)), "application/json"


STRICT_STATUS = {"truncated": {400}, "utf-16": {400}, "content type": {415}, "coerced": {400}}
STRICT_EXAMPLES = {"agent": 20, "model": 8, "resources": 8}


@pytest.mark.parametrize("verb", [v for v in Verb if v is not Verb.STATUS], ids=str)
def test_a_body_the_strict_wire_cannot_take_is_a_4xx_saying_why_and_changes_nothing(
    target: Target, verb: Verb
) -> None:
    """Valid bodies (schemathesis' positive cases, aimed at the held checkpoint) cut short,
    sent in UTF-16/32, under another content type, or with one field in a form lax parsing
    coerces (``"4"`` for 4, ``1`` for true, ``1.0`` for 1): each is refused, with the status
    of its kind, and the status of the participant does not move."""
    cases = target.operation(verb).as_strategy(GenerationMode.POSITIVE)

    @bounded(STRICT_EXAMPLES[target.kind])
    @given(case=cases, start=st.sampled_from(Start), data=st.data())
    def spoiled_is_refused(case: Case, start: Start, data: st.DataObject) -> None:
        target.enter(start)
        try:
            target.aim(case)
            kind, raw, content_type = data.draw(_spoiled(case.body))
            headers = dict(AUTH) | ({} if content_type is None else {"content-type": content_type})
            before = target.fingerprint()
            reply = httpx.post(f"{target.url}{CONTROL_PREFIX}/{verb}", content=raw, headers=headers)
            after = target.fingerprint()
        finally:
            target.reset()
        sent = f"{kind}: {raw[:200]!r} as {content_type}"
        assert reply.status_code in STRICT_STATUS[kind], f"{verb} {sent}: {reply.text[:300]}"
        assert error_code(reply.content) is not None, f"{verb} {sent}: no envelope"
        assert after == before, f"{verb} {sent} changed status {before} -> {after}"

    spoiled_is_refused()


# --- bugs the fuzzer found, each pinned by the test of its fix ---------------------------


def test_an_attempt_beyond_64_bits_is_refused(tmp_path: Path) -> None:
    with serve_target("model", tmp_path) as model:
        before = model.fingerprint()
        body = b'{"episode_ids": [{"rollout_id": "big", "attempt": 208364948706506964992}]}'
        reply = httpx.post(
            f"{model.url}{CONTROL_PREFIX}/{Verb.RETIRE}",
            content=body,
            headers={**AUTH, "content-type": "application/json"},
        )
        after = model.fingerprint()
    assert (reply.status_code, error_code(reply.content)) == (400, "bad_request"), reply.text
    assert after == before


def test_agent_retire_cost_does_not_grow_with_the_attempt(tmp_path: Path) -> None:
    with serve_target("agent", tmp_path) as agent:
        elapsed = {}
        for rollout_id, attempt in (("fuzz-low", 0), ("fuzz-high", 3_000_000)):
            started = time.monotonic()
            body = {"episode_ids": [{"rollout_id": rollout_id, "attempt": attempt}]}
            agent.control(Verb.RETIRE, body)
            elapsed[attempt] = time.monotonic() - started
    # The reply does not depend on the attempt: neither should its cost, beyond noise.
    assert elapsed[3_000_000] < 0.1 + 10 * elapsed[0], elapsed


def test_a_commit_into_a_name_too_long_is_a_bad_path_and_changes_nothing(tmp_path: Path) -> None:
    with serve_target("resources", tmp_path) as live:
        live.enter(Start.PREPARED)
        before = live.fingerprint()
        body = {
            "checkpoint_id": live.held,
            "deadline_ts": time.time() + 600,
            "checkpoint_dir": "x" * 300,
            "episode_ids": [],
        }
        reply = httpx.post(f"{live.url}{CONTROL_PREFIX}/{Verb.COMMIT}", json=body, headers=AUTH)
        after = live.fingerprint()
        live.reset()
    # Refused by validation, before the fence or the file system see it.
    assert (reply.status_code, error_code(reply.content)) == (400, "bad_request"), reply.text
    assert after == before
