"""The ``rollpoint`` command: run a job, serve environment servers, inspect a run.

Owns user-facing I/O only: argument parsing, rich progress and tables, and turning every
:class:`RollpointError` into one red line and a non-zero exit (2 for bad input).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import orjson
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollpoint import __version__
from rollpoint.config import load_config
from rollpoint.job import drive_quietly, prepare_workdir, run_job
from rollpoint.protocol.errors import ConfigError, RollpointError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Checkpoint and recover in-flight agent rollouts.",
)
console = Console(stderr=True)
out = Console()

T = TypeVar("T")

if TYPE_CHECKING:
    from rollpoint.runtime.contract import Runtime
    from rollpoint.trainer.metrics import TrainerMetrics
    from rollpoint.trainer.trainer_loop import RunSummary, Trainer

ConfigArg = Annotated[Path, typer.Argument(help="The run's YAML config.", show_default=False)]


def _run_async(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine; SIGTERM cancels it like Ctrl-C does, so cleanup always runs."""

    async def _main() -> T:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        if task is not None:
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
        return await make()

    return asyncio.run(_main())


def _fail(exc: RollpointError) -> typer.Exit:
    console.print(f"[bold red]error:[/] {exc.message}", highlight=False, soft_wrap=True)
    return typer.Exit(code=2 if isinstance(exc, ConfigError) else 1)


def _say(message: str) -> None:
    console.print(message, highlight=False, soft_wrap=True)


async def _drive_with_progress(
    trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics
) -> RunSummary:
    total = sum(len(trainer.ledger.group_records(g)) for g in trainer.ledger.group_ids())
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
        bar = progress.add_task("episodes", total=total, turns=0, reward=0.0, steps=0, pause="-")
        job = asyncio.create_task(drive_quietly(trainer, runtime, metrics))
        try:
            while not job.done():
                await asyncio.wait({job}, timeout=0.25)
                s = trainer.stats
                pause = (
                    "-" if metrics.last_pause_s is None else f"{metrics.last_pause_s * 1000:.0f} ms"
                )
                progress.update(
                    bar,
                    completed=s.episodes_finished,
                    turns=s.turns,
                    reward=s.reward_mean,
                    steps=s.train_steps,
                    pause=pause,
                )
        finally:
            if not job.done():
                job.cancel()
                await asyncio.gather(job, return_exceptions=True)
        return job.result()


@app.command()
def run(
    config_path: ConfigArg,
    fresh: Annotated[bool, typer.Option("--fresh", help="Start over instead of resuming.")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="With --fresh: delete a non-empty workdir.")
    ] = False,
) -> None:
    """Run a job to the end on the runtime the config names (``runtime:``)."""
    try:
        config = load_config(config_path)
        prepare_workdir(config.workdir, fresh=fresh, force=force)
        _setup_logging(config.workdir)
        summary = _run_async(
            lambda: run_job(config, fresh=fresh, say=_say, drive=_drive_with_progress)
        )
    except RollpointError as exc:
        raise _fail(exc) from None
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]; servers stopped")
        raise typer.Exit(code=130) from None
    table = Table(title="run finished", show_header=False)
    for key, value in summary.model_dump().items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    out.print(table)


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
    WORKDIR/control.token and the data token (for /run, tools and chat) to WORKDIR/data.token,
    both readable by you only, for your coordinator and trainer to send as bearer tokens.
    """
    from rollpoint.runtime.embedded import EmbeddedRuntime
    from rollpoint.store.workdir_lock import lock_workdir
    from rollpoint.trainer.control_plane import snapshot_root

    def _private_token(path: Path) -> str:
        token = secrets.token_urlsafe(32)
        path.unlink(missing_ok=True)
        path.touch(mode=0o600)
        path.write_text(token + "\n")
        return token

    async def _serve() -> None:
        token_file = config.workdir / "control.token"
        token = _private_token(token_file)
        data_file = None if open_data_routes else config.workdir / "data.token"
        data_token = None if data_file is None else _private_token(data_file)
        runtime = EmbeddedRuntime(
            config,
            control_token=token,
            data_token=data_token,
            snapshot_root=snapshot_root(config),
        )
        async with runtime:
            assert runtime.deployment is not None
            if as_json:
                doc = runtime.deployment.model_dump(mode="json") | {
                    "control_token_file": str(token_file),
                    "data_token_file": None if data_file is None else str(data_file),
                }
                typer.echo(orjson.dumps(doc).decode())
            table = Table(title=f"rollpoint servers ({config.environment})")
            for col in ("replica", "model", "agent", "resources"):
                table.add_column(col, overflow="fold")
            for r in runtime.deployment.replicas:
                table.add_row(r.name, r.model_url, r.agent_url, r.resources_url)
            if not as_json:
                out.print(table)
                out.print(f"policy: {runtime.deployment.policy_url}")
                out.print(f"control token: {token_file} (snapshots under {snapshot_root(config)})")
                out.print(f"data token: {data_file or 'none (data routes open)'}")
            console.print("serving; Ctrl-C to stop")
            await asyncio.Event().wait()

    try:
        config = load_config(config_path)
        lock_workdir(config.workdir)  # one writer per workdir, before the token files
        _run_async(_serve)
    except RollpointError as exc:
        raise _fail(exc) from None
    except (KeyboardInterrupt, asyncio.CancelledError):
        console.print("stopped")


@app.command()
def inspect(
    workdir: Annotated[Path, typer.Argument(help="The run's workdir.", show_default=False)],
    store: Annotated[
        str | None,
        typer.Option("--store", help="Snapshot store path or URL (default: WORKDIR/snapshots)."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object, for scripts.")
    ] = False,
) -> None:
    """Show the snapshots of a run and what the latest one holds."""
    from rollpoint.snapshot_report import build_report, render_report

    try:
        report = build_report(store or str(workdir / "snapshots"), workdir=workdir)
    except RollpointError as exc:
        raise _fail(exc) from None
    if as_json:
        typer.echo(orjson.dumps(report).decode())
    else:
        render_report(report, out)


@app.command()
def conformance(
    url: Annotated[
        str, typer.Argument(help="Base URL of the participant server.", show_default=False)
    ],
    token_file: Annotated[
        Path, typer.Option("--token-file", help="File holding the control token.")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check that a server speaks the checkpoint control protocol: every case, passed or failed."""
    from rollpoint.testing.conformance import conformance_command

    raise typer.Exit(code=conformance_command(url, token_file, as_json))


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
) -> None:
    """Run the job N times under random faults (process and replica kills, lost replies,
    partitions, slow participants) and check the invariants of DESIGN §8 after each.

    Trials work in WORKDIR/chaos/trial-<k>. Exit code 1 when any invariant was violated.
    """
    from rollpoint.testing.chaos import chaos_command

    code = chaos_command(
        config_path,
        trials=trials,
        seed=seed,
        json_path=json_path,
        verbose=verbose,
        within_s=within,
        run_timeout_s=run_timeout,
        console=console,
        out=out,
    )
    raise typer.Exit(code=code)


@app.command()
def version() -> None:
    """Print the version."""
    out.print(__version__)


def _setup_logging(workdir: Path) -> None:
    handler = logging.FileHandler(workdir / "rollpoint.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def main() -> None:
    try:
        app()
    except RollpointError as exc:  # pragma: no cover - commands catch their own
        console.print(f"[bold red]error:[/] {exc.message}")
        sys.exit(1)
