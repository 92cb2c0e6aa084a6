"""The ``rollpoint`` command: run a job, serve environment servers, inspect a run.

Owns user-facing I/O only: argument parsing, rich progress and tables, and turning every
:class:`RollpointError` into one red line and a non-zero exit (2 for bad input).

Imports are lazy: at import time this module loads typer, rich's console and the error
tree only, so ``rollpoint --help`` and ``rollpoint version`` answer fast. Each command
imports what it runs (the trainer, aiohttp, the servers) in its own body;
``tests/unit/test_cli_imports.py`` holds the line.
"""

from __future__ import annotations

import logging
import secrets
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich.console import Console

from rollpoint import __version__
from rollpoint.protocol.errors import (
    ConfigError,
    GroupsFailedError,
    RollpointError,
    RunPreemptedError,
)

app = typer.Typer(
    no_args_is_help=True,
    help="Checkpoint and recover in-flight agent rollouts.",
)
console = Console(stderr=True)
out = Console()

PROGRESS_EVERY_S = 3.0
"""Without a terminal (a pipe, a batch job's log), ``run`` prints one plain progress line
this often instead of redrawing a bar."""

T = TypeVar("T")

if TYPE_CHECKING:
    from rollpoint.preemption import StopRequest
    from rollpoint.rollouts import Rollouts

ConfigArg = Annotated[
    Path, typer.Argument(help="The run's YAML config.", show_default=False, metavar="CONFIG")
]


def _run_async(make: Callable[[StopRequest], Awaitable[T]]) -> T:
    """Run a coroutine with SIGTERM and SIGINT handled by a :class:`StopRequest` (a run
    takes a final snapshot on the first); a signal that cancels it outright ends in a
    :class:`RunPreemptedError`, after every cleanup ran."""
    import asyncio

    from rollpoint.preemption import StopRequest, cancelled_line

    async def _main() -> T:
        stop = StopRequest.on_signals()
        try:
            return await make(stop)
        except asyncio.CancelledError:
            if not stop.cancelled:
                raise
            raise RunPreemptedError(cancelled_line(stop), stop.exit_code) from None

    return asyncio.run(_main())


def _show_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _options(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_show_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Checkpoint and recover in-flight agent rollouts."""


def _fail(exc: RollpointError) -> typer.Exit:
    console.print(f"[bold red]error:[/] {exc.message}", highlight=False, soft_wrap=True)
    return typer.Exit(code=2 if isinstance(exc, ConfigError) else 1)


def _say(message: str) -> None:
    console.print(message, highlight=False, soft_wrap=True)


async def _show_progress(run: Rollouts) -> None:
    """Redraw a bar from :meth:`Rollouts.progress` until cancelled (when the run ends)."""
    import asyncio

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    if not console.is_terminal:
        return await _show_lines(run)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "turns {task.fields[turns]} · reward {task.fields[reward]:.3f} · steps {task.fields[steps]}"
            " · last pause {task.fields[pause]}"
        ),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("episodes", total=None, turns=0, reward=0.0, steps=0, pause="-")

        def draw() -> None:
            p = run.progress()
            progress.update(
                bar,
                total=p.episodes_total,
                completed=p.episodes_finished,
                turns=p.turns,
                reward=p.reward_mean,
                steps=p.train_steps,
                pause=_pause(p.last_pause_s),
            )

        try:
            while True:
                draw()
                await asyncio.sleep(0.25)
        finally:
            draw()  # the bar left on screen is the run's end


async def _show_lines(run: Rollouts) -> None:
    """Progress for a pipe or a log file: one plain line every few seconds, and at the end."""
    import asyncio
    import time

    started = time.monotonic()

    def line() -> None:
        p = run.progress()
        elapsed = int(time.monotonic() - started)
        console.print(
            f"episodes {p.episodes_finished}/{p.episodes_total} · in flight {p.in_flight}"
            f" · turns {p.turns} · reward {p.reward_mean:.3f} · steps {p.train_steps}"
            f" · last pause {_pause(p.last_pause_s)} · {elapsed // 60}:{elapsed % 60:02d}",
            highlight=False,
            soft_wrap=True,
        )

    try:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            line()
    finally:
        line()


def _pause(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


class _ConsoleWarnings(logging.Handler):
    """The library's warnings (a snapshot skipped or failed, a replica down) on the console
    as well as in rollpoint.log: an operator watching ``run`` must not have to read the log."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must not break the run
            self.handleError(record)
            return
        console.print(f"[yellow]warning:[/] {message}", highlight=False, soft_wrap=True)


@app.command()
def run(
    config_path: ConfigArg,
    fresh: Annotated[bool, typer.Option("--fresh", help="Start over instead of resuming.")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="With --fresh: delete a non-empty workdir.")
    ] = False,
    attach: Annotated[
        Path | None,
        typer.Option(
            "--attach",
            help="Run on the servers `rollpoint serve --json` started (its line, in this "
            "file) instead of starting any; they are left running.",
        ),
    ] = None,
    retry_failed: Annotated[
        bool,
        typer.Option(
            "--retry-failed",
            help="Resume the run and send its failed groups again under new ids "
            "(what was trained stays trained).",
        ),
    ] = False,
) -> None:
    """Run a job to the end; run the same command again after a crash to resume it.

    The config's runtime key picks where the servers run: embedded (local processes, the
    default) or ray; with --attach, on servers started apart (a trainer killed alone then
    finds them running, and its rerun continues their episodes). Warnings (a snapshot
    skipped or failed, a replica down) show here and in WORKDIR/rollpoint.log.

    Exit status: 0 every group trained; 1 an error stopped the run; 2 refused at start
    (bad config); 3 the run ended (or stopped early) with failed groups; 143/130 stopped
    by SIGTERM/SIGINT after a final snapshot (see "Exit codes" in docs/guide.md).
    """
    from rich.table import Table

    from rollpoint.app import exit_codes
    from rollpoint.app.config import load_config
    from rollpoint.app.full_table import print_full
    from rollpoint.job.run import prepare_workdir
    from rollpoint.loop import run_builtin
    from rollpoint.rollouts import load_served
    from rollpoint.trainer.dispatch.failed_groups import digest

    try:
        config = load_config(config_path)
        served = None if attach is None else load_served(attach)
        settings = config.job_settings()
        prepare_workdir(settings.workdir, fresh=fresh, force=force)
        _setup_logging(settings.workdir)
        summary = _run_async(
            lambda stop: run_builtin(
                settings,
                step_seconds=config.train.step_seconds,
                fresh=fresh,
                deployment=served,
                stop=stop,
                say=_say,
                watch=_show_progress,
                retry_failed=retry_failed,
            )
        )
    except GroupsFailedError as exc:
        _say(_retry_hint(config_path))
        console.print(f"[bold red]error:[/] {exc.message}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=exit_codes.GROUPS_FAILED) from None
    except RunPreemptedError as exc:
        console.print(f"[yellow]{exc.message}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(code=exc.exit_code) from None
    except RollpointError as exc:
        raise _fail(exc) from None
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]; servers stopped")
        raise typer.Exit(code=130) from None
    table = Table(title="run finished", show_header=False)
    for key, value in summary.model_dump().items():
        if key == "failed_groups":
            value = len(summary.failed_groups)  # by reason on the last line, not 400 columns
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    print_full(out, table)
    if summary.failed_groups:
        _say(_retry_hint(config_path))
        console.print(
            f"[bold red]error:[/] the run ended with failed groups: {digest(summary.failed_groups)}",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(code=exit_codes.GROUPS_FAILED)


def _retry_hint(config_path: Path) -> str:
    return (
        f"`rollpoint inspect` lists them with their reasons; once the cause is fixed, "
        f"`rollpoint run {config_path} --retry-failed` sends them again"
    )


@app.command()
def serve(
    config_path: ConfigArg,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the deployment as one JSON line.")
    ] = False,
    open_data_routes: Annotated[
        bool,
        typer.Option(
            "--open-data-routes",
            help="Serve /run, tools and chat without a token (the control routes keep theirs).",
        ),
    ] = False,
) -> None:
    """Start only the environment servers and print their URLs (bring your own trainer).

    Every server is a checkpoint participant; the control token is written to
    WORKDIR/control.token and the data token (for /run, tools, chat and the scripted
    policy) to WORKDIR/data.token, both readable by you only, for your coordinator and
    trainer to send as bearer tokens. Each server serves Prometheus metrics at /metrics.
    """
    import asyncio

    from rich.table import Table

    from rollpoint.app.config import load_config
    from rollpoint.app.full_table import print_full
    from rollpoint.preemption import signal_name
    from rollpoint.protocol.deployment import ServedDeployment
    from rollpoint.runtime.embedded import EmbeddedRuntime
    from rollpoint.store.workdir_lock import lock_workdir

    def _private_token(path: Path) -> str:
        token = secrets.token_urlsafe(32)
        path.unlink(missing_ok=True)
        path.touch(mode=0o600)
        path.write_text(token + "\n")
        return token

    async def _serve(stop: StopRequest) -> None:
        token_file = config.workdir / "control.token"
        token = _private_token(token_file)
        data_file = None if open_data_routes else config.workdir / "data.token"
        data_token = None if data_file is None else _private_token(data_file)
        runtime = EmbeddedRuntime(
            config.runtime_settings(),
            control_token=token,
            data_token=data_token,
            snapshot_root=config.snapshot_root(),
        )
        async with runtime:
            assert runtime.deployment is not None
            if as_json:
                served = ServedDeployment(
                    **runtime.deployment.model_dump(),
                    control_token_file=str(token_file),
                    data_token_file=None if data_file is None else str(data_file),
                    snapshot_store=config.snapshot_root(),
                )
                typer.echo(served.model_dump_json())
            table = Table(title=f"rollpoint servers ({config.environment})")
            for col in ("replica", "model", "agent", "resources"):
                table.add_column(col)
            for r in runtime.deployment.replicas:
                table.add_row(r.name, r.model_url, r.agent_url, r.resources_url)
            if not as_json:
                print_full(out, table)
                for text in (
                    f"policy: {runtime.deployment.policy_url}",
                    f"control token: {token_file} (snapshots under {config.snapshot_root()})",
                    f"data token: {data_file or 'none (data routes open)'}",
                ):
                    out.print(text, soft_wrap=True, highlight=False)
            console.print("serving; Ctrl-C to stop")
            await asyncio.Event().wait()

    try:
        config = load_config(config_path)
        lock_workdir(config.workdir)  # one writer per workdir, before the token files
        _run_async(_serve)
    except RunPreemptedError as exc:
        # Serving has no state of its own to save: a signal just stops the servers.
        console.print(f"stopped by {signal_name(exc.exit_code - 128)}; servers stopped")
    except RollpointError as exc:
        raise _fail(exc) from None
    except (KeyboardInterrupt, asyncio.CancelledError):
        console.print("stopped")


@app.command()
def inspect(
    workdir: Annotated[
        Path, typer.Argument(help="The run's workdir.", show_default=False, metavar="WORKDIR")
    ],
    store: Annotated[
        str | None,
        typer.Option("--store", help="Snapshot store path or URL (default: WORKDIR/snapshots)."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object, for scripts.")
    ] = False,
) -> None:
    """Show the snapshots of a run and what the latest one holds.

    Exits 0 when a snapshot can be restored, 1 when none can (none published, or every one
    damaged: a rerun would then start over), 2 for a workdir that does not exist.
    """
    import orjson

    from rollpoint.app.snapshot_report import build_report, render_report

    try:
        report = build_report(store or str(workdir / "snapshots"), workdir=workdir)
    except RollpointError as exc:
        raise _fail(exc) from None
    if as_json:
        typer.echo(orjson.dumps(report).decode())
    else:
        render_report(report, out)
    if report["latest"] is None:
        raise typer.Exit(code=1)


@app.command()
def report(
    workdir: Annotated[Path, typer.Argument(help="The run's workdir.", show_default=False)],
    output: Annotated[
        Path | None,
        typer.Option(
            "-o", "--output", help="Where to write the page (default: WORKDIR/report.html)."
        ),
    ] = None,
    store: Annotated[
        str | None,
        typer.Option("--store", help="Snapshot store path or URL (default: the run's config's)."),
    ] = None,
    open_page: Annotated[
        bool, typer.Option("--open", help="Open the page in the default browser.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print what was written as one JSON object.")
    ] = False,
) -> None:
    """Write one self-contained HTML page of a run: its timeline, pauses, restores, replicas,
    the latest snapshot's contents and the config it used (works offline, on a live,
    crashed, resumed or finished run)."""
    import orjson

    from rollpoint.common.extras import extra_message, missing

    if missing("report"):
        console.print(
            f"[bold red]error:[/] {extra_message('report', 'rollpoint report')}", highlight=False
        )
        raise typer.Exit(code=1)
    from rollpoint.app.report import read_run, write_report

    try:
        record = read_run(workdir, store)
    except RollpointError as exc:
        raise _fail(exc) from None
    try:
        target = write_report(record, output)
    except OSError as exc:
        console.print(f"[bold red]error:[/] cannot write the report: {exc}", highlight=False)
        raise typer.Exit(code=1) from None
    if as_json:
        doc = {
            "report": str(target),
            "state": record.state,
            "snapshots": len(record.snapshots),
            "restores": len(record.restores),
            "runs": len(record.segments),
        }
        typer.echo(orjson.dumps(doc).decode())
    else:
        out.print(f"report: {target}")
    if open_page:
        import webbrowser

        webbrowser.open(target.resolve().as_uri())


@app.command()
def conformance(
    url: Annotated[
        str | None,
        typer.Argument(
            help="Base URL of the participant server.", show_default=False, metavar="URL"
        ),
    ] = None,
    token_file: Annotated[
        Path | None, typer.Option("--token-file", help="File holding the control token.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    nemo_gym: Annotated[
        Path | None,
        typer.Option(
            "--nemo-gym",
            help="Instead, check a NeMo-Gym resources server's session routes with the"
            " first row of this task file (JSONL).",
        ),
    ] = None,
    environment: Annotated[
        str | None,
        typer.Option(
            "--environment",
            help="Check an environment's own promises instead (a name or package.module:Class):"
            " export/restore, replayed calls, side effects.",
        ),
    ] = None,
) -> None:
    """Check that a server speaks the checkpoint control protocol (or, with --nemo-gym,
    NeMo-Gym's session routes): every case, passed or failed; or, with --environment,
    that an environment keeps its own promises."""
    if environment is not None:
        from rollpoint.testing.environment_conformance import environment_conformance_command

        raise typer.Exit(code=environment_conformance_command(environment))
    if url is None:
        console.print(
            "[bold red]error:[/] conformance needs a URL (or --environment REF)", highlight=False
        )
        raise typer.Exit(code=2)
    from rollpoint.testing.conformance import conformance_command

    raise typer.Exit(code=conformance_command(url, token_file, as_json, nemo_gym_rows=nemo_gym))


@app.command()
def chaos(
    config_path: ConfigArg,
    trials: Annotated[int, typer.Option("--trials", help="How many times to run the job.")],
    seed: Annotated[int, typer.Option("--seed", help="Seed of the faults and moments.")] = 0,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the table as JSON here.")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", help="Add one row per trial.")] = False,
    within: Annotated[
        float, typer.Option("--within", help="Faults land within this many seconds of start.")
    ] = 2.5,
    run_timeout: Annotated[
        float, typer.Option("--run-timeout", help="A run still going after this is wedged.")
    ] = 180.0,
    jobs: Annotated[
        int, typer.Option("--jobs", help="Trials run at once (each is a whole job).")
    ] = 1,
) -> None:
    """Run the job N times under random faults (process and replica kills, lost replies,
    partitions, slow participants) and check after each that nothing was lost or done twice.

    The checks: every row trained exactly once, no tool side effect applied twice, no turn
    finished before a snapshot asked again, the next snapshot still commits, and refusals
    leave nothing changed. Trials work in WORKDIR/chaos/trial-<k>. Exit code 1 when any
    check failed.
    """
    from rollpoint.app.chaos.command import chaos_command

    code = chaos_command(
        config_path,
        trials=trials,
        seed=seed,
        json_path=json_path,
        verbose=verbose,
        within_s=within,
        run_timeout_s=run_timeout,
        jobs=jobs,
        console=console,
        out=out,
    )
    raise typer.Exit(code=code)


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


def _setup_logging(workdir: Path) -> None:
    handler = logging.FileHandler(workdir / "rollpoint.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    library = logging.getLogger("rollpoint")
    if not any(isinstance(h, _ConsoleWarnings) for h in library.handlers):
        library.addHandler(_ConsoleWarnings(logging.WARNING))


def _reflow_help() -> None:
    """Commands' help as paragraphs of plain words: typer keeps a docstring's line breaks
    as they are in the source, which cut sentences mid-line in a wider or narrower terminal."""
    import inspect as pyinspect

    for command in app.registered_commands:
        doc = command.help or (command.callback.__doc__ if command.callback else None)
        if doc:
            paragraphs = pyinspect.cleandoc(doc).split("\n\n")
            command.help = "\n\n".join(" ".join(p.split()) for p in paragraphs)


def main() -> None:
    _reflow_help()
    try:
        app()
    except RollpointError as exc:  # pragma: no cover - commands catch their own
        console.print(f"[bold red]error:[/] {exc.message}")
        sys.exit(1)
