"""The participant conformance kit: run the control protocol's cases against any server.

Owns :func:`check_participant`, which drives a participant's control routes over plain
HTTP through every case of :mod:`rollpoint.testing.conformance_cases` (status shape,
prepare/commit/resume and their replays, stale and conflicting ids, out-of-order verbs,
auth, malformed bodies, path traversal, lease expiry, restore, retire, forget, ack) and
returns a :class:`ConformanceReport`; and :func:`conformance_command`, the body of
``rollpoint conformance URL --token-file F [--json]``.

It needs nothing of rollpoint on the server side: an environment author points it at
their own participant, written in any language. Run it against a quiet participant (no
episode in flight, no coordinator talking to it): it prepares and commits for real, into
``<snapshot root>/<snapshot_dir>/<run tag>/<case>``, and only ever uses checkpoint and
rollout ids starting with ``conformance-``. Each case ends with the participant idle: the
ids it used are resumed and its rollouts forgotten in a ``finally``; a case that leaves
the participant held stops the run (the remaining cases are reported as not run).

It does not start servers (tests do) and does not check the data plane.
:func:`check_participant` needs no extra; the printed table needs rich (the ``cli`` extra).
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from pydantic import computed_field

from rollpoint.http.auth import load_token
from rollpoint.protocol.control import JOURNAL, Phase, Verb
from rollpoint.protocol.errors import ConfigError, RollpointError, TransportError
from rollpoint.protocol.model_base import StrictModel
from rollpoint.testing.conformance_cases import CASES, Case
from rollpoint.testing.conformance_probe import CaseFailed, Probe, Trial

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["CaseResult", "ConformanceReport", "check_participant", "conformance_command"]

_TIMEOUT_S = 30.0
"""Per request; a quiet participant answers every verb at once."""


class CaseResult(StrictModel):
    name: str
    passed: bool
    detail: str
    """One line: what was checked on a pass, what differed on a failure."""
    seconds: float


class ConformanceReport(StrictModel):
    url: str
    participant: str | None
    """``<kind> <name>/<replica>`` from its status, when that could be read."""
    cases: list[CaseResult]
    journals: bool | None = None
    """Whether it journals its completed work (status feature ``journal``,
    docs/journal.md): a restore then replays its journal after the snapshot's mark; without
    it, it is restored from snapshots alone (the protocol's cut). None: status unread."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ok(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def failed(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.passed]

    def to_table(self) -> Table:
        from rich.table import Table

        title = f"conformance of {self.participant or 'participant'} at {self.url}"
        table = Table(title=title, title_justify="left")
        table.add_column("case")
        table.add_column("result")
        table.add_column("seconds", justify="right")
        table.add_column("detail", overflow="fold")
        for c in self.cases:
            verdict = "[green]pass[/]" if c.passed else "[bold red]FAIL[/]"
            table.add_row(c.name, verdict, f"{c.seconds:.2f}", c.detail)
        passed = len(self.cases) - len(self.failed)
        journal = {
            True: "; journals its work (feature 'journal'): restores replay its journal",
            False: "; does not journal: restored from snapshots alone",
            None: "",
        }[self.journals]
        table.caption = f"{passed}/{len(self.cases)} passed{journal}"
        return table


async def check_participant(
    url: str,
    token: str,
    *,
    snapshot_dir: str = "conformance",
    lease_grace_s_hint: float | None = None,
    local_root: Path | None = None,
) -> ConformanceReport:
    """Run every conformance case against the participant at ``url`` (its base URL).

    ``snapshot_dir`` is the folder under the participant's snapshot root the commits go
    to. ``lease_grace_s_hint`` is the participant's lease grace, if known (else at most
    10 s is assumed, and the lease case takes that long to fail). ``local_root``, when
    the participant's snapshot root is readable from here, also checks each committed
    manifest and records file on disk. Raises :class:`TransportError` if ``url`` cannot
    be reached at all; everything else is a case result.
    """
    run_tag = secrets.token_hex(4)
    async with httpx.AsyncClient(timeout=_TIMEOUT_S) as client:
        probe = Probe(client, url, token)
        try:
            await probe.send(Verb.STATUS)
        except httpx.HTTPError as exc:
            raise TransportError(
                f"cannot reach a participant at {url}: {type(exc).__name__}: {exc}"
            ) from None
        results: list[CaseResult] = []
        halted: str | None = None
        for name, run in CASES:
            if halted is not None:
                results.append(CaseResult(name=name, passed=False, detail=halted, seconds=0.0))
                continue
            trial = Trial(probe, run_tag, name, snapshot_dir, lease_grace_s_hint, local_root)
            result, left_held = await _run_case(name, run, trial)
            results.append(result)
            if name == "status" and not result.passed:
                halted = "not run: the status case failed"
            elif left_held:
                halted = f"not run: case {name} left the participant held"
        label, journals = await _label(probe)
        return ConformanceReport(url=url, participant=label, cases=results, journals=journals)


async def _run_case(name: str, run: Case, trial: Trial) -> tuple[CaseResult, bool]:
    """Run one case, then put the participant back to idle; True if that failed."""
    started = time.monotonic()
    passed = False
    try:
        detail = await run(trial)
        passed = True
    except CaseFailed as exc:
        detail = str(exc)
    except httpx.HTTPError as exc:
        detail = f"HTTP failure: {type(exc).__name__}: {exc}"
    finally:
        left = await _cleanup(trial)
    if left is not None:
        detail = f"{detail}; {left}" if not passed else left
        passed = False
    seconds = round(time.monotonic() - started, 3)
    result = CaseResult(name=name, passed=passed, detail=detail, seconds=seconds)
    return result, left is not None


async def _cleanup(trial: Trial) -> str | None:
    """Resume every id the case used and forget its rollouts; the problem if not idle after."""
    probe = trial.probe
    try:
        for cid in trial.checkpoint_ids:
            await probe.send(Verb.RESUME, {"checkpoint_id": cid})
        if trial.rollout_ids:
            await probe.send(Verb.FORGET, {"rollout_ids": trial.rollout_ids})
        status = await probe.status()
    except (CaseFailed, httpx.HTTPError) as exc:
        return f"cleanup failed: {exc}"
    if status.phase is not Phase.IDLE:
        return (
            f"after resuming its ids the participant is {status.phase} "
            f"(checkpoint {status.checkpoint_id}), not idle"
        )
    return None


async def _label(probe: Probe) -> tuple[str | None, bool | None]:
    """``<kind> <name>/<replica>`` and whether it journals, from its status."""
    try:
        s = await probe.status()
    except (CaseFailed, httpx.HTTPError):
        return None, None
    return f"{s.kind} {s.name}/{s.replica}", JOURNAL in s.features


def conformance_command(
    url: str,
    token_file: Path | None,
    as_json: bool,
    *,
    lease_grace_s_hint: float | None = None,
    nemo_gym_rows: Path | None = None,
) -> int:
    """``rollpoint conformance``: print the report (a table, or JSON); the exit code.

    0 when every case passed, 1 when one failed or the URL cannot be reached, 2 for bad
    input (an unreadable or empty token file, a URL that is not http(s)). With
    ``nemo_gym_rows`` the server is a NeMo-Gym resources server
    (:mod:`rollpoint.testing.nemo_gym_conformance`) and no token is needed.
    """
    from rich.console import Console

    errors = Console(stderr=True)
    try:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{url!r} is not a participant's base URL (http:// or https://)")
        if nemo_gym_rows is not None:
            from rollpoint.testing.nemo_gym_conformance import check_nemo_gym

            report = check_nemo_gym(url, nemo_gym_rows)
        elif token_file is None:
            raise ConfigError("--token-file is needed (the participant's control token)")
        else:
            token = load_token(file=token_file)
            report = asyncio.run(
                check_participant(url, token, lease_grace_s_hint=lease_grace_s_hint)
            )
    except httpx.ConnectError as exc:
        errors.print(f"[bold red]error:[/] {url}: {exc}", highlight=False, soft_wrap=True)
        return 1
    except RollpointError as exc:
        errors.print(f"[bold red]error:[/] {exc.message}", highlight=False, soft_wrap=True)
        return 2 if isinstance(exc, ConfigError) else 1
    if as_json:
        sys.stdout.write(report.model_dump_json() + "\n")
    else:
        Console().print(report.to_table())
    return 0 if report.ok else 1
