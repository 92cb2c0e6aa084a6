"""The ``openenv:<target>`` environments: an OpenEnv environment server behind one tool.

Owns the reference, the class made for each one, the ``openenv_step`` tool, and the saved
form of an episode. The OpenEnv server a reference names (one this process starts, or one at
a URL) is :mod:`~rollpoint.envs.openenv_server`'s; the one OpenEnv session per episode over
OpenEnv's WebSocket protocol (the messages OpenEnv's own ``EnvClient`` sends,
:class:`~rollpoint.envs.openenv_session.Session`) and the loop it lives on are
:mod:`~rollpoint.envs.openenv_session`'s.

- **Reference**: ``openenv:<module>:<attr>`` names an OpenEnv server app (what
  ``openenv.core.env_server.create_app`` returns; ``server.app:app`` in an environment made by
  ``openenv init``): each process that plays it starts it once, in a child process on a free
  loopback port, and the child ends when that process ends (even by SIGKILL: it watches a
  pipe from its parent). The child imports the app without gradio, which OpenEnv's server
  package imports for its web interface, unless ``ENABLE_WEB_INTERFACE`` is set or the app
  imports gradio itself (:func:`~rollpoint.envs.openenv_server.import_app`).
  ``openenv:http://host:port`` plays a server already running there.
  A suffix says how episodes survive a crash: ``@replay`` (the default) or ``@restart``.
- **Episodes**: one WebSocket session each (``/ws``: the server's per-connection environment),
  ``reset(seed, episode_id)`` at the start with the seed from the task. The server must allow
  as many concurrent sessions as episodes run at once (``create_app(...,
  max_concurrent_envs=N)``): a refused session is one EpisodeError naming the server.
- **The tool** ``openenv_step`` takes the action's fields as the server's ``/schema``
  describes them (``metadata`` is left out); the server validates them, and a refusal is
  the model's error, not a step. The result is JSON: ``step``, ``observation``, ``reward``,
  ``done``.
- **Saved** (``@replay``, ``turn`` mode): ``{"seed", "episode_id", "reset", "actions",
  "trace", "replayed", "restarts", "server_state"}``: the reset reply, every action taken and
  each reply ``[observation, reward, done]`` as it came. A restore
  (:mod:`~rollpoint.envs.action_replay`) opens a new session,
  resets with the same seed and episode id, replays the actions and checks every reply
  against the recorded one and then the environment's own ``state`` (its ``step_count``
  must be the number of actions, its ``episode_id`` the saved one). A mismatch is one logged
  line naming the environment and the task; the episode restarts from its seed, its next
  tool result says so (``notice``) and its verify detail counts it (``restarts``).
  ``@restart`` (an environment not deterministic from its seed): nothing is replayed, every
  restore restarts the episode and reports it the same way.
- **Verify**: the environment's ``state`` (read from the server at verify, kept as
  ``server_state``) and the rewards of the steps: the reward is the last step's, clamped to
  [0, 1] (OpenEnv environments give their outcome as the reward of the final step); the
  detail carries the return, the steps, ``done``, ``replayed``, ``restarts`` and the state.

Not here: the ``external`` checkpoint mode (an episode continued on a server session that
outlived the crash, through ``Environment.attach``): an OpenEnv WebSocket session ends with
its connection, so none outlives the process that held it; such environments use
``@restart``.

Sessions are async; the interface is not: every session lives on one event loop per process,
in a daemon thread; the tool awaits its call from the server's loop, the other methods wait
for theirs (why not OpenEnv's own client: :mod:`~rollpoint.envs.openenv_session`). OpenEnv
(and websockets) come with the ``openenv`` extra.
"""

from __future__ import annotations

import functools
import logging
import random
import re
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

import orjson
from pydantic import ConfigDict, Field, JsonValue, ValidationError

from rollpoint.common.extras import need
from rollpoint.envs.action_replay import Replay, check_seeded, read_saved, restart_notice
from rollpoint.envs.base import Environment, Tool, ToolArgumentError, ToolArguments
from rollpoint.envs.openenv_server import import_app, serve, server_url
from rollpoint.envs.openenv_session import Session, SessionError, SessionLost, _await, _wait
from rollpoint.protocol.episode import TaskRow, VerifyReply
from rollpoint.protocol.errors import ConfigError, EpisodeError
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import CheckpointMode

__all__ = [
    "PREFIX",
    "STEP_TOOL",
    "OpenEnvEnvironment",
    "OpenEnvEpisode",
    "OpenEnvParams",
    "Session",
    "SessionError",
    "SessionLost",
    "import_app",
    "openenv_environment",
    "serve",
    "server_url",
]

PREFIX = "openenv:"
STEP_TOOL = "openenv_step"
_REFERENCE = re.compile(
    r"^openenv:(?P<target>https?://[^\s@]+|[A-Za-z_][\w.]*:[A-Za-z_]\w*)"
    r"(?:@(?P<mode>replay|restart))?$"
)
_ACTION_REFUSED = frozenset({"VALIDATION_ERROR", "EXECUTION_ERROR", "UNKNOWN_TYPE"})
"""Server error codes that answer the action itself: the model's mistake, not a step. (An
environment whose ``step`` raised after changing its state is caught at the next restore:
its ``step_count`` no longer matches the actions replayed.)"""

log = logging.getLogger(__name__)


# ---- the environment class a reference names -------------------------------------------
@functools.cache
def openenv_environment(ref: str) -> type[OpenEnvEnvironment]:
    """The environment class ``openenv:<target>[@replay|@restart]`` names, made once per
    process (its server is reached when an instance is made)."""
    match = _REFERENCE.match(ref)
    if match is None:
        raise ConfigError(
            f"environment {ref!r}: want openenv:<module>:<app> or openenv:http://host:port,"
            " optionally followed by @replay or @restart"
        )
    need("openenv", f"environment {ref!r}")
    replay = match["mode"] != "restart"
    attrs = {
        "name": ref,
        "target": match["target"],
        "replay": replay,
        "checkpoint_mode": CheckpointMode.TURN,
        "__module__": __name__,
        "__doc__": f"The OpenEnv environment {match['target']} behind the openenv_step tool.",
    }
    return type(f"OpenEnv[{match['target']}]", (OpenEnvEnvironment,), attrs)


class OpenEnvParams(StrictModel):
    seed: Annotated[int, Field(ge=0, lt=2**31)]


class _Action(ToolArguments):
    """The action's fields as the model sent them; the server validates them."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


@dataclass(frozen=True)
class _ActionTool(Tool[Any, _Action]):
    """``openenv_step``: its schema is the server's action schema, not a pydantic model's,
    asked of the server when the spec is first wanted (a process that only makes tasks or
    checks the tools starts no server)."""

    parameters: Callable[[], dict[str, JsonValue]] = dict

    def spec(self) -> dict[str, JsonValue]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters(),
            },
        }

    def parse(self, arguments: Mapping[str, Any]) -> _Action:
        if "metadata" in arguments:
            raise ToolArgumentError(f"{self.name}: unexpected argument 'metadata'")
        return _Action.model_validate(dict(arguments))


def _action_parameters(schema: Mapping[str, Any]) -> dict[str, JsonValue]:
    """The server's action JSON schema as a tool's parameters, without ``metadata``."""
    properties = {k: v for k, v in dict(schema.get("properties", {})).items() if k != "metadata"}
    required = [r for r in schema.get("required", ()) if r != "metadata"]
    parameters: dict[str, JsonValue] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    if "$defs" in schema:
        parameters["$defs"] = schema["$defs"]
    parameters["additionalProperties"] = False
    return parameters


Reply = tuple[JsonValue, JsonValue, bool]
"""What the server answered to a reset or a step: ``[observation, reward, done]``."""
_REPLY_SHOWS = "[observation, reward, done]"


class _Saved(StrictModel):
    seed: int
    episode_id: str
    reset: tuple[JsonValue, JsonValue, bool]
    actions: list[dict[str, JsonValue]]
    trace: list[tuple[JsonValue, JsonValue, bool]]
    replayed: Annotated[int, Field(ge=0)]
    restarts: Annotated[int, Field(ge=0)]
    server_state: dict[str, JsonValue] | None = None


@dataclass
class OpenEnvEpisode:
    """One episode: its OpenEnv session and everything that rebuilds it."""

    client: Session
    seed: int
    episode_id: str
    """Passed to ``reset``: the server's state names the episode by it."""
    reset: Reply
    actions: list[dict[str, JsonValue]] = field(default_factory=list)
    trace: list[Reply] = field(default_factory=list)
    replayed: int = 0
    """Actions replayed by restores of this episode, all of them added up."""
    restarts: int = 0
    """Restores that started the episode again from its seed (a divergence, or ``@restart``)."""
    notice: str | None = None
    """Said with the next tool result (the episode restarted), then cleared."""
    server_state: dict[str, JsonValue] | None = None
    """The environment's own ``state`` as the server gave it at verify."""

    @property
    def done(self) -> bool:
        return bool(self.trace) and self.trace[-1][2]


def _reply(data: Mapping[str, Any]) -> Reply:
    """A reset or step reply's ``data`` (``{"observation", "reward", "done"}``)."""
    return (data.get("observation", {}), data.get("reward"), bool(data.get("done", False)))


def _params(task: TaskRow) -> OpenEnvParams:
    try:
        return OpenEnvParams.model_validate(task.params)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise EpisodeError(f"task {task.task_id}: bad params at '{loc}': {err['msg']}") from None


class OpenEnvEnvironment(Environment[OpenEnvEpisode]):
    """An OpenEnv environment server; :func:`openenv_environment` makes one class per reference.

    Subclass it to name it by import path with other settings: set ``target`` and
    ``replay``, and override :meth:`reward` or :meth:`prompt`."""

    name: ClassVar[str] = "openenv"
    target: ClassVar[str] = ""
    replay: ClassVar[bool] = True
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.TURN
    reproducible_start: ClassVar[bool] = False  # an unreplayed episode still has a session

    def __init__(self) -> None:
        need("openenv", f"environment {self.name!r}")
        if not self.target:
            raise ConfigError(f"environment {self.name!r}: no target (name openenv:<target>)")
        super().__init__()
        self._url: str | None = None
        self._tool: _ActionTool | None = None
        self._action_schema: dict[str, JsonValue] | None = None

    # ---- the server ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The server's base URL; a server this process serves is started at first use."""
        if self._url is None:
            self._url = server_url(self.target, self.name)
        return self._url

    def _parameters(self) -> dict[str, JsonValue]:
        if self._action_schema is None:
            self._action_schema = _action_parameters(self._schema()["action"])
        return self._action_schema

    def _schema(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"{self.url}/schema", timeout=10) as reply:
                schema: dict[str, Any] = orjson.loads(reply.read())
        except (urllib.error.URLError, OSError, orjson.JSONDecodeError) as exc:
            raise ConfigError(
                f"environment {self.name!r}: GET {self.url}/schema failed ({exc})"
            ) from None
        return schema

    def _where(self, task: TaskRow) -> str:
        return f"{self.name}: task {task.task_id}"

    async def _open(self, seed: int, episode_id: str, where: str) -> tuple[Session, Reply]:
        from websockets.exceptions import WebSocketException

        try:
            session = await Session.open(self.url)
        except (OSError, WebSocketException, TimeoutError) as exc:
            raise EpisodeError(f"{where}: OpenEnv session at {self.url} failed: {exc}") from None
        try:
            data = await session.ask("reset", {"seed": seed, "episode_id": episode_id})
        except (SessionError, SessionLost) as exc:  # capacity reached, a reset that raised
            await session.close()
            raise EpisodeError(f"{where}: OpenEnv reset at {self.url} failed: {exc}") from None
        return session, _reply(data)

    # ---- tool ---------------------------------------------------------------------------
    def tool_table(self) -> Mapping[str, Tool[OpenEnvEpisode, Any]]:
        if self._tool is None:
            self._tool = _ActionTool(
                STEP_TOOL,
                "Take one action in the environment; answers the new observation, the reward"
                " and whether the episode is over.",
                _Action,
                self._step,
                self._parameters,
            )
        return {STEP_TOOL: self._tool}

    async def _step(self, state: OpenEnvEpisode, args: _Action) -> str:
        if state.done:
            raise ToolArgumentError(f"{STEP_TOOL}: the episode is over; give your final answer")
        action: dict[str, JsonValue] = dict(args.model_extra or {})
        reply = await _await(self._send_step(state, action))
        state.actions.append(action)
        state.trace.append(reply)
        out: dict[str, JsonValue] = {
            "step": len(state.actions),
            "observation": reply[0],
            "reward": reply[1],
            "done": reply[2],
        }
        if state.notice is not None:
            out["notice"], state.notice = state.notice, None
        return orjson.dumps(out).decode()

    async def _send_step(self, state: OpenEnvEpisode, action: dict[str, JsonValue]) -> Reply:
        try:
            return _reply(await state.client.ask("step", action))
        except SessionError as exc:
            if exc.code in _ACTION_REFUSED:
                raise ToolArgumentError(f"{STEP_TOOL}: {exc.message}") from None
            raise EpisodeError(f"{self.name}: OpenEnv step failed: {exc}") from None
        except SessionLost as exc:  # the step may or may not have happened: never resent
            raise EpisodeError(f"{self.name}: {exc}") from None

    # ---- tasks --------------------------------------------------------------------------
    def _make_task(self, index: int, rng: random.Random) -> TaskRow:
        seed = rng.randrange(2**31)
        return TaskRow(
            task_id=self.task_id(index),
            environment=self.name,
            prompt=self.prompt(seed),
            params={"seed": seed},
        )

    def task_id(self, index: int) -> str:
        return f"openenv-{index:04d}"

    def prompt(self, seed: int) -> str:
        return (
            f"Play the OpenEnv environment at {self.target}. Call {STEP_TOOL} with one action"
            " per call; each result shows the observation, the reward and whether the"
            " episode is over. When it is over, give your final answer."
        )

    # ---- episodes -----------------------------------------------------------------------
    def start(self, task: TaskRow) -> OpenEnvEpisode:
        seed = _params(task).seed
        episode_id = f"{task.task_id}-{uuid.uuid4().hex[:12]}"
        client, reset = _wait(self._open(seed, episode_id, self._where(task)))
        return OpenEnvEpisode(client=client, seed=seed, episode_id=episode_id, reset=reset)

    def reward(self, state: OpenEnvEpisode) -> float:
        """The episode's reward in [0, 1]: the last step's reward, clamped."""
        if not state.trace or not isinstance(state.trace[-1][1], int | float):
            return 0.0
        return min(1.0, max(0.0, float(state.trace[-1][1])))

    def verify(
        self, state: OpenEnvEpisode, task: TaskRow, final_message: str | None
    ) -> VerifyReply:
        try:
            server_state = _wait(state.client.ask("state"))
        except Exception as exc:
            raise EpisodeError(f"{self._where(task)}: OpenEnv state failed: {exc}") from None
        state.server_state = orjson.loads(orjson.dumps(server_state, default=str))
        detail: dict[str, Any] = {
            "steps": len(state.actions),
            "return": sum(float(r) for _, r, _ in state.trace if isinstance(r, int | float)),
            "done": state.done,
            "replayed": state.replayed,
            "restarts": state.restarts,
            "server_state": state.server_state,
        }
        return VerifyReply(reward=self.reward(state), detail=detail)

    def export_state(self, state: OpenEnvEpisode) -> dict[str, JsonValue]:
        return {
            "seed": state.seed,
            "episode_id": state.episode_id,
            "reset": list(state.reset),
            "actions": [dict(a) for a in state.actions],
            "trace": [list(step) for step in state.trace],
            "replayed": state.replayed,
            "restarts": state.restarts,
            "server_state": state.server_state,
        }

    def side_effects(self, state: OpenEnvEpisode) -> Counter[str]:
        """Each step the episode took, by its index: a step applied twice is a step more
        than the transcript's calls."""
        return Counter(
            f"step {i + 1}: {orjson.dumps(a, option=orjson.OPT_SORT_KEYS).decode()}"
            for i, a in enumerate(state.actions)
        )

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> OpenEnvEpisode:
        seed = _params(task).seed
        saved = read_saved(_Saved, exported, self.name, task)
        check_seeded(self.name, task, seed, saved.seed, len(saved.actions), len(saved.trace))
        return _wait(self._restore(task, saved))

    async def _restore(self, task: TaskRow, saved: _Saved) -> OpenEnvEpisode:
        where = self._where(task)
        client, reset = await self._open(saved.seed, saved.episode_id, where)
        replay = Replay(
            where, saved.actions, [list(step) for step in saved.trace], shows=_REPLY_SHOWS
        )
        if self.replay:
            await self._replay(client, saved, reset, replay)
            if replay.diverged is None:
                return OpenEnvEpisode(
                    client=client,
                    seed=saved.seed,
                    episode_id=saved.episode_id,
                    reset=saved.reset,
                    actions=list(saved.actions),
                    trace=list(saved.trace),
                    replayed=saved.replayed + replay.replayed,
                    restarts=saved.restarts,
                )
            log.warning("%s", replay.diverged)
            await client.close()
            client, reset = await self._open(saved.seed, saved.episode_id, where)
        else:
            log.warning(
                "%s: restarts from its seed (@restart: %d actions not replayed)",
                where,
                len(saved.actions),
            )
        return OpenEnvEpisode(
            client=client,
            seed=saved.seed,
            episode_id=saved.episode_id,
            reset=reset,
            replayed=saved.replayed + replay.replayed,
            restarts=saved.restarts + 1,
            notice=restart_notice("its first observation", "step"),
        )

    async def _replay(
        self, client: Session, saved: _Saved, reset: Reply, replay: Replay[dict[str, JsonValue]]
    ) -> None:
        """Replay the saved actions on a fresh session, each reply and then the
        environment's own state checked: ``replay`` says how far it went, and where it
        went another way."""
        if not replay.check_start(list(reset), list(saved.reset), _REPLY_SHOWS):
            return
        for action in replay:
            try:
                got = _reply(await client.ask("step", action))
            except (SessionError, SessionLost) as exc:
                replay.failed(exc)
                return
            replay.answered(list(got))
        if replay.diverged is not None:
            return
        state = await client.ask("state")
        count, episode = state.get("step_count"), state.get("episode_id")
        if (count is not None and count != len(saved.actions)) or (
            episode is not None and episode != saved.episode_id
        ):
            replay.diverged = (
                f"{replay.where}: after replay the environment's state says step_count"
                f" {count!r}, episode_id {episode!r} (want {len(saved.actions)},"
                f" {saved.episode_id!r}); the episode restarts from its seed"
            )

    def close(self, state: OpenEnvEpisode) -> None:
        _wait(state.client.close())
