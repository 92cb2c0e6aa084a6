"""The ``sandbox`` environment: a working directory per episode, file tools, a deterministic check.

Modelled on coding-agent tasks. Each episode gets its own directory (under ``$SANDBOX_ROOT``,
else a fresh temporary folder per process) holding the task's starting files. The tools
write, append a line to, read and list files there, and ``run_check`` tells which of the
task's requirements the files meet (no shell: a requirement is a file that must exist,
contain a text, equal a text, or have a number of lines). The verifier's reward is the share
of requirements met.

Checkpointing: ``turn`` mode. The state is the directory tree; a snapshot holds it as a tar
archive in base64 with its SHA-256 (:mod:`sandbox_env.tree`), which restores onto any
replica byte-exact. A restore refuses an archive with a symlink or a path outside the
working directory, naming the task (the resources server adds the rollout). ``fs_append``
is not idempotent by nature: a repeated call would add the line twice. Exactly-once comes
from rollpoint's idempotency keys (a replayed call gets the saved result and does not run),
not from anything here.

Two tools show the call interface beyond ``run(state, args)``: ``fs_append`` takes the
call's context (``ToolContext``) and logs each line it adds under its idempotency key (an
environment that wrote somewhere outside its state would pass that key along, so a repeat
could be recognised there); ``run_check`` is marked ``@slow_tool``, as a check that runs a
test suite would be, so the resources server runs it in a worker thread and other
episodes' calls go on meanwhile.

Start is reproducible (the starting files come from the task alone), so an episode no tool
has touched is saved as its task.

With ``$SANDBOX_KEEP_FINAL`` set to a folder, the verifier also writes each episode's final
tree there (``<task_id>-<sha256>.tar``): a run's results can be inspected, and a test counts
applied appends from the trees themselves.

Uses only rollpoint's public API (``rollpoint.envs``).
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from rollpoint.envs import (
    CheckpointMode,
    Environment,
    EpisodeError,
    InvalidCheckpointStateError,
    NoArguments,
    TaskRow,
    Tool,
    ToolArgumentError,
    ToolArguments,
    ToolContext,
    VerifyReply,
    slow_tool,
)
from sandbox_env.tree import TreeError, pack_tree, read_tree, unpack_tree

PATH_PATTERN = r"^[a-z][a-z0-9_]{0,15}(/[a-z][a-z0-9_]{0,15}){0,2}\.(txt|md|py)$"
MAX_FILES = 64
MAX_TREE_BYTES = 256 * 1024
_READ_LIMIT = 4000

FilePath = Annotated[str, Field(pattern=PATH_PATTERN, max_length=60)]


class WriteArgs(ToolArguments):
    path: FilePath
    content: Annotated[str, Field(max_length=4000)]


class AppendArgs(ToolArguments):
    path: FilePath
    line: Annotated[str, Field(max_length=200, pattern=r"^[^\n]*$")]


class PathArgs(ToolArguments):
    path: FilePath


class Requirement(BaseModel):
    """One thing ``run_check`` looks at: a file, and what it must hold."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    path: FilePath
    check: Literal["exists", "contains", "equals", "min_lines"]
    text: str = ""
    """``contains``/``equals``: the text; unused otherwise."""
    lines: int = 0
    """``min_lines``: at least this many lines."""


class SandboxParams(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    files: dict[str, str] = Field(default_factory=dict)
    """The starting files: relative path → text."""
    requirements: Annotated[list[Requirement], Field(min_length=1)]


@dataclass
class SandboxState:
    workdir: Path
    """This episode's working directory: everything a tool changes lives there."""
    requirements: list[Requirement]
    """What ``run_check`` looks at: the task's, so a restore takes them from the task."""


def _params(task: TaskRow) -> SandboxParams:
    try:
        return SandboxParams.model_validate(task.params)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "params"
        raise EpisodeError(f"task {task.task_id}: bad params at '{loc}': {err['msg']}") from None


def _file(state: SandboxState, path: str) -> Path:
    # The pattern already keeps a path relative and free of '..'; the tree never holds a
    # symlink (restore refuses them), so the joined path stays inside the working dir.
    return state.workdir / path


def _tree_size(state: SandboxState) -> tuple[int, int]:
    files = [p for p in state.workdir.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _check_room(state: SandboxState, target: Path, adding: int) -> None:
    count, size = _tree_size(state)
    if not target.exists() and count >= MAX_FILES:
        raise ToolArgumentError(f"the sandbox holds {MAX_FILES} files already")
    if size + adding > MAX_TREE_BYTES:
        raise ToolArgumentError(f"the sandbox would exceed {MAX_TREE_BYTES} bytes")


def _write(state: SandboxState, args: WriteArgs) -> str:
    target = _file(state, args.path)
    if target.is_dir():
        raise ToolArgumentError(f"{args.path} is a directory")
    data = args.content.encode()
    _check_room(state, target, len(data) - (target.stat().st_size if target.exists() else 0))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return f"wrote {len(data)} bytes to {args.path}"


def _append(state: SandboxState, args: AppendArgs, ctx: ToolContext) -> str:
    target = _file(state, args.path)
    if target.is_dir():
        raise ToolArgumentError(f"{args.path} is a directory")
    data = (args.line + "\n").encode()
    _check_room(state, target, len(data))
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("ab") as handle:
        handle.write(data)
    # The key is the same for every try of this call (a retry, a continued attempt after a
    # restore): what an outside system would be given to tell a repeat from a new line.
    ctx.logger.info("appended a line to %s (key %s)", args.path, ctx.idempotency_key)
    lines = target.read_bytes().count(b"\n")
    return f"appended a line to {args.path} (now {lines} lines)"


def _read(state: SandboxState, args: PathArgs) -> str:
    target = _file(state, args.path)
    if not target.is_file():
        raise ToolArgumentError(f"no file {args.path}")
    text = target.read_bytes().decode(errors="replace")
    return text if len(text) <= _READ_LIMIT else text[:_READ_LIMIT] + "\n[... truncated]"


@slow_tool  # a real check runs a test suite: off the event loop, in a worker thread
def _run_check(state: SandboxState, args: NoArguments) -> str:
    return orjson.dumps(_report(state)).decode()


def _list(state: SandboxState, args: NoArguments) -> str:
    files = read_tree(state.workdir)
    return orjson.dumps([{"path": p, "bytes": len(d)} for p, d in files.items()]).decode()


def _meets(files: Mapping[str, bytes], req: Requirement) -> bool:
    data = files.get(req.path)
    if data is None:
        return False
    text = data.decode(errors="replace")
    if req.check == "contains":
        return req.text in text
    if req.check == "equals":
        return text == req.text
    if req.check == "min_lines":
        return text.count("\n") >= req.lines
    return True


def _report(state: SandboxState) -> dict[str, Any]:
    files = read_tree(state.workdir)
    results = [
        {"path": r.path, "check": r.check, "ok": _meets(files, r)} for r in state.requirements
    ]
    return {"passed": sum(1 for r in results if r["ok"]), "total": len(results), "results": results}


class SandboxEnvironment(Environment[SandboxState]):
    """Files in a per-episode working directory; reward: the share of requirements met."""

    name: ClassVar[str] = "sandbox"
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.TURN
    reproducible_start: ClassVar[bool] = True

    def __init__(self) -> None:
        configured = os.environ.get("SANDBOX_ROOT")
        if configured:
            self._root = Path(configured)
            self._root.mkdir(parents=True, exist_ok=True)
        else:
            self._root = Path(tempfile.mkdtemp(prefix="rollpoint-sandbox-"))
            atexit.register(shutil.rmtree, self._root, True)
        keep = os.environ.get("SANDBOX_KEEP_FINAL")
        self._keep = Path(keep) if keep else None
        self._tools: dict[str, Tool[SandboxState, Any]] = {}
        for tool in (
            Tool("fs_write", "Create or overwrite a file with the given text.", WriteArgs, _write),
            Tool(
                "fs_append", "Append one line (a newline is added) to a file.", AppendArgs, _append
            ),
            Tool("fs_read", "Read a file's text.", PathArgs, _read),
            Tool("fs_list", "List every file with its size in bytes.", NoArguments, _list),
            Tool(
                "run_check",
                "Check the files against the task's requirements.",
                NoArguments,
                _run_check,
            ),
        ):
            self._tools[tool.name] = tool

    # ---- tasks -------------------------------------------------------------------------
    def _make_task(self, index: int, rng: random.Random) -> TaskRow:
        lines = rng.randint(2, 4)
        word = rng.choice(("ready", "done", "shipped", "green"))
        params = SandboxParams(
            files={"notes.txt": "todo\n"},
            requirements=[
                Requirement(path="log.txt", check="min_lines", lines=lines),
                Requirement(path="notes.txt", check="contains", text=word),
            ],
        )
        prompt = (
            f"In the working directory, append at least {lines} lines to log.txt, and make"
            f" notes.txt contain the word {word!r}. Use run_check to see how you are doing."
        )
        return TaskRow(
            task_id=self.task_id(index),
            environment=self.name,
            prompt=prompt,
            params=params.model_dump(mode="json"),
        )

    # ---- tools -------------------------------------------------------------------------
    def tool_table(self) -> Mapping[str, Tool[SandboxState, Any]]:
        return self._tools

    # ---- episodes ----------------------------------------------------------------------
    def _new_workdir(self) -> Path:
        return Path(tempfile.mkdtemp(prefix="ep-", dir=self._root))

    def start(self, task: TaskRow) -> SandboxState:
        params = _params(task)
        state = SandboxState(self._new_workdir(), list(params.requirements))
        for rel, text in sorted(params.files.items()):
            target = state.workdir / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        return state

    def verify(self, state: SandboxState, task: TaskRow, final_message: str | None) -> VerifyReply:
        report = _report(state)
        if self._keep is not None:
            archive = pack_tree(read_tree(state.workdir))
            digest = hashlib.sha256(archive).hexdigest()
            self._keep.mkdir(parents=True, exist_ok=True)
            (self._keep / f"{task.task_id}-{digest}.tar").write_bytes(archive)
        reward = report["passed"] / report["total"]
        return VerifyReply(reward=reward, detail=report)

    def export_state(self, state: SandboxState) -> dict[str, JsonValue]:
        return self.capture_state(state)()

    def capture_state(self, state: SandboxState) -> Callable[[], dict[str, JsonValue]]:
        # The copy (file bytes) is taken now, inside the checkpoint's pause; the tar and
        # its base64 are made later, in the snapshot writer's thread.
        files = read_tree(state.workdir)

        def encode() -> dict[str, JsonValue]:
            archive = pack_tree(files)
            return {
                "format": "tar",
                "archive": base64.b64encode(archive).decode("ascii"),
                "sha256": hashlib.sha256(archive).hexdigest(),
            }

        return encode

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> SandboxState:
        where = f"sandbox state of task {task.task_id}"
        if set(exported) != {"format", "archive", "sha256"} or exported["format"] != "tar":
            raise InvalidCheckpointStateError(
                f"{where}: want keys format (tar), archive, sha256; got {sorted(exported)}"
            )
        try:
            archive = base64.b64decode(str(exported["archive"]), validate=True)
        except ValueError:
            raise InvalidCheckpointStateError(f"{where}: archive is not base64") from None
        if hashlib.sha256(archive).hexdigest() != exported["sha256"]:
            raise InvalidCheckpointStateError(f"{where}: archive does not match its sha256")
        state = SandboxState(self._new_workdir(), list(_params(task).requirements))
        try:
            unpack_tree(archive, state.workdir)
        except TreeError as exc:
            shutil.rmtree(state.workdir, ignore_errors=True)
            raise InvalidCheckpointStateError(f"{where}: {exc}") from None
        return state

    def close(self, state: SandboxState) -> None:
        shutil.rmtree(state.workdir, ignore_errors=True)
