"""The ``gymnasium:<env id>`` environments: any registered Gymnasium environment behind one tool.

Owns the reference (``gymnasium:FrozenLake-v1``, or ``gymnasium:FrozenLake-v1@pkg.mod:func``
with a function of the user's that renders observations), the class made for each one, the
``gym_step`` tool, the text the policy sees, the reward mapping, and the saved form of an
episode: its seed plus the actions taken, restored by replaying them with a divergence check.

- **Actions**: a ``Discrete(n, start)`` action space takes ``{"action": <int>}`` in
  ``[start, start + n)``; a ``Text`` action space takes ``{"action": <str>}`` within its
  lengths and charset. Anything else is refused when the reference is resolved.
- **Observations** become text by :func:`default_text` (the ``ansi`` render where the
  environment has one, coloured cells shown as ``[X]``, then ``observation: <value>``), or by
  the user's ``func(env, observation) -> str``.
- **Saved**: ``{"seed", "reset", "actions", "trace", "replayed", "restarts"}`` where ``trace``
  holds ``[observation, reward, terminated, truncated]`` of every step as it happened.
  A restore resets the environment with the seed and replays the actions; every replayed
  step must give the recorded entry. A mismatch is one logged line naming the environment
  and the task, and the episode restarts from its seed: its next tool result says so and
  its verify detail counts it (``restarts``).
- **Verify**: 1.0 when the episode terminated on a positive reward (FrozenLake's goal,
  Taxi's drop-off), else 0.0; the detail carries the return and the step count.

Gymnasium and numpy come with the ``gym`` extra: resolving a ``gymnasium:`` reference
without them is a one-line ConfigError.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import random
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from pydantic import Field, JsonValue, ValidationError, create_model

from rollpoint.common.extras import need
from rollpoint.envs.action_replay import Replay, check_seeded, read_saved, restart_notice
from rollpoint.envs.base import Environment, Tool, ToolArgumentError, ToolArguments
from rollpoint.protocol.episode import TaskRow, VerifyReply
from rollpoint.protocol.errors import ConfigError, EpisodeError
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import CheckpointMode

PREFIX = "gymnasium:"
STEP_TOOL = "gym_step"
_REFERENCE = re.compile(
    r"^gymnasium:(?P<env_id>[A-Za-z_][\w./-]*?)"
    r"(?:@(?P<render>[A-Za-z_][\w.]*:[A-Za-z_]\w*))?$"
)
_COLOURED = re.compile(r"\x1b\[[\d;]*m([^\x1b]*)\x1b\[0m")
_ESCAPE = re.compile(r"\x1b\[[\d;]*m")

log = logging.getLogger(__name__)

Render = Callable[[Any, Any], str]
"""``func(env, observation) -> str``: the Gymnasium env (wrappers included) and the
observation it just returned."""

ACTION_NAMES: dict[str, tuple[str, ...]] = {
    "FrozenLake": ("left", "down", "right", "up"),
    "FrozenLake8x8": ("left", "down", "right", "up"),
    "Taxi": ("south", "north", "east", "west", "pickup", "dropoff"),
    "CliffWalking": ("up", "right", "down", "left"),
}
"""What each integer action means, by the env id's name (before ``-v``), said in the prompt."""


def _load_function(path: str, ref: str) -> Render:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: quote whatever it raised
        raise ConfigError(
            f"environment {ref!r}: cannot import module {module_name!r}"
            f" ({type(exc).__name__}: {exc})"
        ) from None
    value = getattr(module, attr, None)
    if not callable(value):
        raise ConfigError(
            f"environment {ref!r}: {path} is not a function (want func(env, observation) -> str)"
        )
    render: Render = value
    return render


def record(value: Any) -> JsonValue:
    """An observation (or reward) as JSON: numpy values through ``tolist``, tuples as lists."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "tolist"):
        made: JsonValue = value.tolist()
        return made
    if isinstance(value, tuple | list):
        return [record(v) for v in value]
    if isinstance(value, dict):
        return {str(k): record(v) for k, v in value.items()}
    return repr(value)


def default_text(env: Any, observation: Any) -> str:
    """The ``ansi`` render (coloured cells as ``[X]``, other escapes dropped) where the
    environment renders so, then ``observation: <value>`` (``of n`` for a Discrete space)."""
    lines: list[str] = []
    if env.render_mode == "ansi":
        drawn = str(env.render())
        lines.append(_ESCAPE.sub("", _COLOURED.sub(r"[\1]", drawn)).strip("\n"))
    space = env.observation_space
    value = json.dumps(record(observation))
    if type(space).__name__ == "Discrete":
        value += f" (one of {int(space.n)} states)"
    lines.append(f"observation: {value}")
    return "\n".join(lines)


@functools.cache
def gymnasium_environment(ref: str) -> type[GymnasiumEnvironment]:
    """The environment class ``gymnasium:<env id>[@module:function]`` names, made once per
    process; ConfigError naming the reference when Gymnasium lacks the id or its action
    space is neither Discrete nor Text."""
    match = _REFERENCE.match(ref)
    if match is None:
        raise ConfigError(
            f"environment {ref!r}: want gymnasium:<env id> or gymnasium:<env id>@module:function"
        )
    need("gym", f"environment {ref!r}")
    import gymnasium as gym

    env_id = match["env_id"]
    try:
        gym.spec(env_id)
    except gym.error.Error as exc:
        raise ConfigError(f"environment {ref!r}: {exc}") from None
    render = _load_function(match["render"], ref) if match["render"] else None
    try:
        probe = gym.make(env_id)
    except Exception as exc:  # a missing optional dependency of Gymnasium's, bad kwargs
        raise ConfigError(
            f"environment {ref!r}: gymnasium.make({env_id!r}) failed ({type(exc).__name__}: {exc})"
        ) from None
    try:
        ansi = "ansi" in probe.metadata.get("render_modes", ())
        kind = type(probe.action_space).__name__
    finally:
        probe.close()
    if kind not in ("Discrete", "Text"):
        raise ConfigError(
            f"environment {ref!r}: action space {kind} is not supported (want Discrete or Text)"
        )
    attrs = {
        "name": ref,
        "env_id": env_id,
        "ansi": ansi,
        "render_function": staticmethod(render) if render is not None else None,
        "__module__": __name__,
        "__doc__": f"Gymnasium's {env_id} behind the gym_step tool.",
    }
    return type(f"Gymnasium[{env_id}]", (GymnasiumEnvironment,), attrs)


class GymParams(StrictModel):
    seed: Annotated[int, Field(ge=0, lt=2**31)]


Step = tuple[JsonValue, JsonValue, bool, bool]


class _Saved(StrictModel):
    seed: int
    reset: JsonValue
    actions: list[int | str]
    trace: list[tuple[JsonValue, JsonValue, bool, bool]]
    replayed: Annotated[int, Field(ge=0)]
    restarts: Annotated[int, Field(ge=0)]


@dataclass
class GymState:
    """One episode: the live Gymnasium env, and everything that rebuilds it."""

    env: Any
    seed: int
    reset: JsonValue
    actions: list[int | str] = field(default_factory=list)
    trace: list[Step] = field(default_factory=list)
    replayed: int = 0
    """Actions replayed by restores of this episode, all of them added up."""
    restarts: int = 0
    """Restores whose replay diverged, each one restarting the episode from its seed."""
    notice: str | None = None
    """Said with the next tool result (the episode restarted), then cleared."""

    @property
    def done(self) -> bool:
        return bool(self.trace) and (self.trace[-1][2] or self.trace[-1][3])


def _params(task: TaskRow) -> GymParams:
    try:
        return GymParams.model_validate(task.params)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise EpisodeError(f"task {task.task_id}: bad params at '{loc}': {err['msg']}") from None


class GymnasiumEnvironment(Environment[GymState]):
    """A registered Gymnasium environment; :func:`gymnasium_environment` makes one per id.

    Subclass it to name it by import path with other settings: set ``env_id``,
    ``make_kwargs`` (passed to ``gymnasium.make``) and override :meth:`text` or
    :meth:`reward`."""

    name: ClassVar[str] = "gymnasium"
    env_id: ClassVar[str] = ""
    make_kwargs: ClassVar[Mapping[str, Any]] = {}
    ansi: ClassVar[bool] = False
    render_function: ClassVar[Render | None] = None
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.TURN
    reproducible_start: ClassVar[bool] = True  # reset(seed) from the task

    def __init__(self) -> None:
        need("gym", f"environment {self.name!r}")
        if not self.env_id:
            raise ConfigError(f"environment {self.name!r}: no env_id (name gymnasium:<env id>)")
        super().__init__()
        probe = self._make()
        try:
            self._action_space = probe.action_space
            self._tool = self._step_tool(probe.action_space)
        finally:
            probe.close()

    # ---- the Gymnasium env -----------------------------------------------------------
    def _make(self) -> Any:
        import gymnasium as gym

        kwargs = dict(self.make_kwargs)
        if self.ansi and self.render_function is None:
            kwargs.setdefault("render_mode", "ansi")
        return gym.make(self.env_id, **kwargs)

    def text(self, env: Any, observation: Any) -> str:
        """What the policy reads of an observation (the user's function, or the default)."""
        render = type(self).render_function
        return (render or default_text)(env, observation)

    def reward(self, state: GymState) -> float:
        """The episode's reward in [0, 1]: 1.0 when it terminated on a positive reward."""
        if not state.trace:
            return 0.0
        _, last, terminated, _ = state.trace[-1]
        return 1.0 if terminated and isinstance(last, int | float) and last > 0 else 0.0

    def _fresh(self, seed: int) -> tuple[Any, Any]:
        env = self._make()
        observation, _ = env.reset(seed=seed)
        return env, observation

    # ---- tool ---------------------------------------------------------------------------
    def _step_tool(self, space: Any) -> Tool[GymState, Any]:
        kind = type(space).__name__
        if kind == "Discrete":
            low, high = int(space.start), int(space.start + space.n - 1)
            action: Any = Annotated[
                int, Field(ge=low, le=high, description=f"an integer from {low} to {high}")
            ]
        elif kind == "Text":
            action = Annotated[
                str,
                Field(
                    min_length=int(space.min_length),
                    max_length=int(space.max_length),
                    description="the action as text",
                ),
            ]
        else:
            raise ConfigError(
                f"environment {self.name!r}: action space {kind} is not supported"
                " (want Discrete or Text)"
            )
        arguments = create_model("GymStepArguments", __base__=ToolArguments, action=(action, ...))
        return Tool(
            STEP_TOOL,
            f"Take one action in {self.env_id}; answers the new observation, the reward and"
            " whether the episode is over.",
            arguments,
            self._step,
        )

    def tool_table(self) -> Mapping[str, Tool[GymState, Any]]:
        return {STEP_TOOL: self._tool}

    def _step(self, state: GymState, args: Any) -> str:
        if state.done:
            raise ToolArgumentError(f"{STEP_TOOL}: the episode is over; give your final answer")
        action = args.action
        if not self._action_space.contains(action):
            raise ToolArgumentError(f"{STEP_TOOL}: {action!r} is not in {self._action_space}")
        observation, reward, terminated, truncated, _ = state.env.step(action)
        state.actions.append(action)
        entry: Step = (record(observation), record(reward), bool(terminated), bool(truncated))
        state.trace.append(entry)
        reply: dict[str, JsonValue] = {
            "step": len(state.actions),
            "observation": entry[0],
            "reward": entry[1],
            "terminated": entry[2],
            "truncated": entry[3],
            "text": self.text(state.env, observation),
        }
        if state.notice is not None:
            reply["notice"], state.notice = state.notice, None
        return json.dumps(reply)

    # ---- tasks --------------------------------------------------------------------------
    def _make_task(self, index: int, rng: random.Random) -> TaskRow:
        seed = rng.randrange(2**31)
        env, observation = self._fresh(seed)
        try:
            first = self.text(env, observation)
        finally:
            env.close()
        return TaskRow(
            task_id=self.task_id(index),
            environment=self.name,
            prompt=self.prompt(first),
            params={"seed": seed},
        )

    def task_id(self, index: int) -> str:
        return f"{re.sub(r'[^A-Za-z0-9_-]', '_', self.env_id)}-{index:04d}"

    def prompt(self, first_observation: str) -> str:
        space = self._action_space
        if type(space).__name__ == "Discrete":
            names = ACTION_NAMES.get(self.env_id.rsplit("/", 1)[-1].split("-v")[0])
            start = int(space.start)
            if names is not None and len(names) == int(space.n):
                actions = ", ".join(f"{start + i} = {n}" for i, n in enumerate(names))
            else:
                actions = f"an integer from {start} to {start + int(space.n) - 1}"
        else:
            actions = "text"
        return (
            f"Play the Gymnasium environment {self.env_id}. Actions: {actions}. Call {STEP_TOOL}"
            " with one action per call until the episode is over, then give your final"
            f" answer.\n\nThe first observation:\n{first_observation}"
        )

    # ---- episodes -----------------------------------------------------------------------
    def start(self, task: TaskRow) -> GymState:
        seed = _params(task).seed
        env, observation = self._fresh(seed)
        return GymState(env=env, seed=seed, reset=record(observation))

    def verify(self, state: GymState, task: TaskRow, final_message: str | None) -> VerifyReply:
        detail: dict[str, Any] = {
            "steps": len(state.actions),
            "return": sum(float(r) for _, r, _, _ in state.trace if isinstance(r, int | float)),
            "terminated": bool(state.trace) and state.trace[-1][2],
            "truncated": bool(state.trace) and state.trace[-1][3],
            "replayed": state.replayed,
            "restarts": state.restarts,
        }
        return VerifyReply(reward=self.reward(state), detail=detail)

    def export_state(self, state: GymState) -> dict[str, JsonValue]:
        return {
            "seed": state.seed,
            "reset": state.reset,
            "actions": list(state.actions),
            "trace": [list(step) for step in state.trace],
            "replayed": state.replayed,
            "restarts": state.restarts,
        }

    def side_effects(self, state: GymState) -> Counter[str]:
        """Each step the episode took, by its index: an action applied twice is a step more
        than the transcript's calls, which the crash tests compare against."""
        return Counter(f"step {i + 1}: action {a!r}" for i, a in enumerate(state.actions))

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> GymState:
        seed = _params(task).seed
        saved = read_saved(_Saved, exported, self.name, task)
        check_seeded(self.name, task, seed, saved.seed, len(saved.actions), len(saved.trace))
        env, observation = self._fresh(seed)
        replay = Replay(
            f"{self.name}: task {task.task_id}",
            saved.actions,
            [list(step) for step in saved.trace],
            shows="[observation, reward, terminated, truncated]",
        )
        if replay.check_start(record(observation), saved.reset, "observation"):
            for action in replay:
                observation, reward, terminated, truncated, _ = env.step(action)
                replay.answered(
                    [record(observation), record(reward), bool(terminated), bool(truncated)]
                )
        if replay.diverged is None:
            return GymState(
                env=env,
                seed=seed,
                reset=saved.reset,
                actions=list(saved.actions),
                trace=[(o, r, t, u) for o, r, t, u in saved.trace],
                replayed=saved.replayed + replay.replayed,
                restarts=saved.restarts,
            )
        log.warning("%s", replay.diverged)
        env.close()
        env, observation = self._fresh(seed)
        return GymState(
            env=env,
            seed=seed,
            reset=record(observation),
            replayed=saved.replayed + replay.replayed,
            restarts=saved.restarts + 1,
            notice=restart_notice("its first observation", "step"),
        )

    def close(self, state: GymState) -> None:
        state.env.close()
