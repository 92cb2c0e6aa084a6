"""The ``rollpoint`` command: run a job, serve environment servers, inspect a run.

Owns user-facing I/O only: argument parsing, rich progress and tables, and turning every
:class:`RollpointError` into one red line and a non-zero exit (2 for bad input).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import orjson
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollpoint import __version__
from rollpoint.config import RunConfig, load_config
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import ConfigError, RollpointError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Checkpoint and recover in-flight agent rollouts.",
)
console = Console(stderr=True)
out = Console()

T = TypeVar("T")

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


def load_tasks_for(config: RunConfig) -> list[TaskRow]:
    from rollpoint.envs import get_environment, load_tasks

    if config.dataset is not None:
        tasks = load_tasks(config.dataset)
        wrong = [t.task_id for t in tasks if t.environment != config.environment]
        if wrong:
            raise ConfigError(
                f"{config.dataset}: task {wrong[0]} is for another environment than '{config.environment}'"
            )
        return tasks
    assert config.tasks is not None
    return get_environment(config.environment).make_tasks(config.tasks, config.seed)


def prepare_workdir(workdir: Path, *, fresh: bool, force: bool) -> None:
    """--fresh starts over: on an empty workdir, or with --force on a used one."""
    used = workdir.exists() and any(workdir.iterdir())
    if fresh and used:
        if not force:
            raise ConfigError(f"workdir {workdir} is not empty; --fresh needs --force to delete it")
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)


def _forget_unresumable_run(workdir: Path) -> None:
    """Outputs of a run that left no usable snapshot: its rollouts start over, so what it
    trained on is dropped too (every group is then trained exactly once)."""
    from rollpoint.trainer.trainer_loop import TRAIN_DATA_FILE

    leftovers = [workdir / TRAIN_DATA_FILE, workdir / "checkpoints"]
    if any(p.exists() for p in leftovers):
        console.print(f"[yellow]no usable snapshot in {workdir}; starting the job over[/]")
        (workdir / TRAIN_DATA_FILE).unlink(missing_ok=True)
        shutil.rmtree(workdir / "checkpoints", ignore_errors=True)


async def _run_job(config: RunConfig, *, fresh: bool) -> Any:
    from rollpoint.http.client import HttpClient
    from rollpoint.runtime.embedded import EmbeddedRuntime
    from rollpoint.store.snapshot_store import SnapshotStore
    from rollpoint.trainer.control_plane import (
        ControlPlane,
        config_fingerprint,
        participant_clients,
        snapshot_root,
    )
    from rollpoint.trainer.metrics import TrainerMetrics
    from rollpoint.trainer.restorer import Restorer, check_config, choose_resume_point
    from rollpoint.trainer.train_checkpoint import TrainCheckpointStore
    from rollpoint.trainer.trainer_loop import TRAIN_DATA_FILE, Trainer

    tasks = load_tasks_for(config)
    total = len(tasks) * config.group_size
    token = secrets.token_urlsafe(32)
    root = snapshot_root(config)
    store = await asyncio.to_thread(SnapshotStore, root, config.snapshot.keep)
    checkpoints = TrainCheckpointStore(config.workdir / "checkpoints")
    point = None if fresh else await asyncio.to_thread(choose_resume_point, store, checkpoints)
    if point is None:
        _forget_unresumable_run(config.workdir)
    else:
        check_config(point.manifest, config_fingerprint(config))
    metrics = TrainerMetrics(config.workdir / "metrics.jsonl")
    with console.status(f"starting {config.replicas} replica(s) of '{config.environment}'…"):
        runtime = EmbeddedRuntime(config, control_token=token, snapshot_root=root)
        deployment = await runtime.start()
    control_http = HttpClient(token=token, timeout_s=60)
    try:
        port = metrics.serve(config.host)
        console.print(
            f"[green]servers up[/]: {config.replicas} replica(s), policy at {deployment.policy_url}; "
            f"metrics at http://{config.host}:{port}/metrics",
            highlight=False,
        )
        control = ControlPlane(participant_clients(deployment, control_http), store, metrics)
        restored = None
        if point is not None:
            with console.status(f"restoring snapshot {point.manifest.snapshot_id}…"):
                restored = await Restorer(control.participants).restore(
                    point, train_data=config.workdir / TRAIN_DATA_FILE
                )
            console.print(
                f"[green]resumed[/] from snapshot {restored.snapshot_id} at train step {restored.checkpoint.step}: "
                f"{len(restored.continued)} episodes continued, {restored.restarted} restarted, "
                f"{restored.adopted} finished replies adopted, {restored.tq_requeued} TQ items requeued",
                highlight=False,
            )
        trainer = Trainer(config, deployment, tasks, control=control, restored=restored)
        return await _drive_with_progress(trainer, runtime, total, metrics)
    finally:
        await control_http.aclose()
        metrics.close()
        await runtime.stop()


async def _drive_with_progress(trainer: Any, runtime: Any, total: int, metrics: Any) -> Any:
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
        job = asyncio.create_task(trainer.run())
        # A replica whose process dies is restarted empty; the trainer re-sends its rows.
        watch = asyncio.create_task(runtime.supervise(trainer.replica_down, trainer.replica_up))
        try:
            while not job.done():
                await asyncio.wait({job, watch}, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
                if watch.done() and not job.done():
                    watch.result()  # the policy died: raise why
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
            for task in (job, watch):
                if not task.done():
                    task.cancel()
            await asyncio.gather(job, watch, return_exceptions=True)
        return job.result()


@app.command()
def run(
    config_path: ConfigArg,
    fresh: Annotated[bool, typer.Option("--fresh", help="Start over instead of resuming.")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="With --fresh: delete a non-empty workdir.")
    ] = False,
) -> None:
    """Run a job to the end on the embedded runtime."""
    try:
        config = load_config(config_path)
        prepare_workdir(config.workdir, fresh=fresh, force=force)
        _setup_logging(config.workdir)
        summary = _run_async(lambda: _run_job(config, fresh=fresh))
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
) -> None:
    """Start only the environment servers and print their URLs (bring your own trainer).

    Every server is a checkpoint participant; the control token is written to
    WORKDIR/control.token (readable by you only) for your coordinator to send.
    """
    from rollpoint.runtime.embedded import EmbeddedRuntime
    from rollpoint.trainer.control_plane import snapshot_root

    async def _serve() -> None:
        token_file = config.workdir / "control.token"
        token = secrets.token_urlsafe(32)
        token_file.touch(mode=0o600)
        token_file.write_text(token + "\n")
        runtime = EmbeddedRuntime(config, control_token=token, snapshot_root=snapshot_root(config))
        async with runtime:
            assert runtime.deployment is not None
            if as_json:
                doc = runtime.deployment.model_dump(mode="json") | {
                    "control_token_file": str(token_file)
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
            console.print("serving; Ctrl-C to stop")
            await asyncio.Event().wait()

    try:
        config = load_config(config_path)
        config.workdir.mkdir(parents=True, exist_ok=True)
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
