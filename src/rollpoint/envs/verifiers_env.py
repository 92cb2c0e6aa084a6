"""The ``verifiers:<module>[:<attr>]`` environments: a verifiers ``MultiTurnEnv`` played turn by turn.

Owns the reference, loading the verifiers environment, and the mapping onto rollpoint's
environment interface, so rollpoint's agent and resources servers play a verifiers
environment the user already has, unchanged:

- **Reference**: ``verifiers:<module>`` calls the module's ``load_environment()`` (what a
  verifiers environment package exposes, and what ``vf.load_environment`` calls; a ``-`` in
  the name reads as ``_``); ``verifiers:<module>:<attr>`` names another function, or the
  environment object itself. It must give a ``vf.MultiTurnEnv`` (``SingleTurnEnv`` is one).
- **Tasks**: row ``i`` of the environment's dataset (``get_dataset()``, in its order, wrapping
  around) is task ``i``; its prompt messages joined are the task's prompt, and the row itself
  (JSON) is ``params["input"]``.
- **The policy's turn** is a call of the one tool, ``vf_respond({"content": ...})``: it is
  the assistant message of the turn, added to the trajectory as the verifiers rollout loop
  adds a model response; then the stop conditions run, and unless one fired the
  environment's turn (``get_prompt_messages``, which calls ``env_response``) answers; its
  messages are the tool result. Once a stop condition fired, ``vf_respond`` is refused and
  the policy gives its final answer. A final answer given while the environment still goes
  on is the last assistant message of the completion (so a ``SingleTurnEnv`` needs no tool
  call at all).
- **Verify** renders the completion and runs the environment's rubric
  (``rubric.score_rollout``): the reward clamped to [0, 1]; the detail holds the rubric's own
  reward and metrics and the stop condition. The reward functions get the prompt and the
  completion as the ``Rubric`` documents them, messages as dicts (:class:`RubricMessage`,
  whose fields also read as attributes), not verifiers' message objects, which a reward
  function written to that contract cannot read.
- **Saved** (``turn`` mode): the conversation (``messages``), the trajectory steps (each as
  the length of its prompt in ``messages`` plus reward, advantage, truncation and extras) and
  every other key of the verifiers ``state`` as JSON (messages as dicts). The keys rollpoint
  rebuilds from the task on restore are not saved: ``input``, ``task``, ``prompt``,
  ``client``, ``model``, ``sampling_args``, ``tool_defs``, ``timing``, ``trajectory_id``,
  ``completion``, ``usage_tracker``, ``usage``. A key that is not JSON (an open connection, a
  game object) cannot be saved: the snapshot fails with one line naming the key, and the run
  goes on. A restore does not call ``setup_state`` again: the saved state is the state.

verifiers is async; the interface is not: the environment's coroutines run on one event
loop per process, in a daemon thread, and each method waits for its own. verifiers comes with the ``verifiers``
extra: resolving a ``verifiers:`` reference without it is a one-line ConfigError.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import re
import signal
import threading
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import orjson
from pydantic import Field, JsonValue

from rollpoint.common.extras import need
from rollpoint.envs.base import Environment, Tool, ToolArgumentError, ToolArguments
from rollpoint.protocol.episode import TaskRow, VerifyReply
from rollpoint.protocol.errors import ConfigError, EpisodeError, InvalidCheckpointStateError
from rollpoint.protocol.participant import CheckpointMode

PREFIX = "verifiers:"
RESPOND_TOOL = "vf_respond"
_REFERENCE = re.compile(r"^verifiers:(?P<module>[A-Za-z_][\w.-]*)(?::(?P<attr>[A-Za-z_]\w*))?$")
REBUILT_KEYS = frozenset(
    {
        "input",
        "task",
        "prompt",
        "client",
        "model",
        "sampling_args",
        "tool_defs",
        "timing",
        "trajectory",
        "trajectory_id",
        "completion",
        "usage_tracker",
        "usage",
    }
)
"""State keys rebuilt from the task on restore (``trajectory`` is saved in its own form)."""
_MESSAGE_KEYS = frozenset({"final_env_response"})
"""Saved keys holding verifiers messages: turned back into message objects on restore."""
_TIMEOUT_S = 300.0
T = TypeVar("T")


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    """The event loop every verifiers coroutine of this process runs on, in a daemon thread
    of its own (started at the first use): the interface's methods are synchronous, and the
    resources server calls them from its own running loop."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="verifiers loop", daemon=True).start()
            _LOOP = loop
        return _LOOP


class NotJson(Exception):
    """A value of the state that JSON cannot hold, and where it is."""

    def __init__(self, where: str, value: object) -> None:
        super().__init__(where)
        self.where = where
        self.kind = type(value).__name__


def to_json(value: Any, where: str) -> JsonValue:
    """``value`` as JSON data (pydantic models, e.g. messages, as their dump); NotJson naming
    the first part that is not."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out: dict[str, JsonValue] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise NotJson(f"{where}[{key!r}]", key)
            out[key] = to_json(item, f"{where}.{key}")
        return out
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return to_json(dump(mode="json", exclude_none=True), where)
    raise NotJson(where, value)


@functools.cache
def verifiers_environment(ref: str) -> type[VerifiersEnvironment]:
    """The environment class ``verifiers:<module>[:<attr>]`` names, made once per process
    (the verifiers environment itself is loaded by each instance)."""
    match = _REFERENCE.match(ref)
    if match is None:
        raise ConfigError(
            f"environment {ref!r}: want verifiers:<module> or verifiers:<module>:<attr>"
        )
    need("verifiers", f"environment {ref!r}")
    attrs = {
        "name": ref,
        "module": match["module"].replace("-", "_"),
        "attribute": match["attr"] or "load_environment",
        "__module__": __name__,
        "__doc__": f"The verifiers environment {ref} played turn by turn.",
    }
    cls = type(f"Verifiers[{match['module']}]", (VerifiersEnvironment,), attrs)
    cls()  # load it once here: a config naming something else fails before any server starts
    return cls


class RespondArgs(ToolArguments):
    content: str = Field(min_length=1, description="your message to the environment")


@dataclass
class VfEpisode:
    """One episode: the verifiers state and the conversation as the environment sees it."""

    state: Any
    messages: list[Any]
    """The prompt messages of the next model turn (verifiers message objects)."""
    finished: bool = False
    """The final answer was added (verify ran once)."""


def _text(messages: list[Any]) -> str:
    parts = []
    for message in messages:
        content = getattr(message, "content", None)
        if content is None and isinstance(message, dict):
            content = message.get("content")
        parts.append(content if isinstance(content, str) else orjson.dumps(content).decode())
    return "\n\n".join(p for p in parts if p)


class RubricMessage(dict[str, Any]):
    """A message as a reward function gets it: a dict, as verifiers' ``Rubric`` documents
    (``completion: list[dict[str, str]] | str``) and as reward functions written to that
    contract test for (``isinstance(m, dict)``), whose fields also read as attributes, as
    on verifiers' own message objects (``m.content``).

    verifiers 0.3 hands its message objects, which are no dicts: staros-stardata's reward
    then scores the list's ``repr`` instead of the reply (0.3625 for a perfect haiku), and
    a trained reward is not the rubric's score of what the policy said."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _for_rubric(messages: Any) -> Any:
    """``messages`` (verifiers message objects or dicts; a string stays one) as
    :class:`RubricMessage` values, every field present (None where unset)."""
    if not isinstance(messages, list):
        return messages
    out = []
    for message in messages:
        dump = getattr(message, "model_dump", None)
        fields = dump(mode="json") if callable(dump) else dict(message)
        out.append(RubricMessage(fields))
    return out


class VerifiersEnvironment(Environment[VfEpisode]):
    """A verifiers ``MultiTurnEnv``; :func:`verifiers_environment` makes one class per reference."""

    name: ClassVar[str] = "verifiers"
    module: ClassVar[str] = ""
    attribute: ClassVar[str] = "load_environment"
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.TURN

    def __init__(self) -> None:
        need("verifiers", f"environment {self.name!r}")
        super().__init__()
        self.vf_env = self._load()
        self._rows: list[dict[str, JsonValue]] | None = None
        self._tools: dict[str, Tool[VfEpisode, Any]] = {
            RESPOND_TOOL: Tool(
                RESPOND_TOOL,
                "Send your next message to the environment; it answers with its reply, or"
                " says the episode is over.",
                RespondArgs,
                self.respond,
            )
        }

    def _load(self) -> Any:
        import verifiers as vf

        where = f"environment {self.name!r}"
        try:
            module = importlib.import_module(self.module)
        except Exception as exc:  # the user's package: quote whatever it raised
            raise ConfigError(
                f"{where}: cannot import module {self.module!r} ({type(exc).__name__}: {exc})"
            ) from None
        value = getattr(module, self.attribute, None)
        if value is None:
            raise ConfigError(
                f"{where}: module {self.module!r} has no attribute {self.attribute!r}"
            )
        if not isinstance(value, vf.MultiTurnEnv) and callable(value):
            # A verifiers Environment sets SIGINT and SIGTERM handlers of its own when it is
            # made (tear down, then exit 143): that would take a SIGTERM from rollpoint's
            # servers and trainer, whose graceful stop (a final snapshot) needs it. Keep ours.
            kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                value = value()
            except Exception as exc:
                raise ConfigError(
                    f"{where}: {self.module}:{self.attribute}() failed ({type(exc).__name__}: {exc})"
                ) from None
            finally:
                for sig, handler in kept.items():
                    if handler is not None:
                        signal.signal(sig, handler)
        if not isinstance(value, vf.MultiTurnEnv):
            raise ConfigError(
                f"{where}: {self.module}:{self.attribute} gave a {type(value).__name__},"
                " not a verifiers MultiTurnEnv"
            )
        return value

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, _loop()).result(_TIMEOUT_S)

    # ---- tasks --------------------------------------------------------------------------
    def rows(self) -> list[dict[str, JsonValue]]:
        """The dataset's rows as JSON, in order."""
        if self._rows is None:
            dataset = self.vf_env.get_dataset()
            rows = []
            for index in range(len(dataset)):
                try:
                    row = to_json(dict(dataset[index]), "row")
                except NotJson as exc:
                    raise ConfigError(
                        f"environment {self.name!r}: dataset row {index}: {exc.where} is a"
                        f" {exc.kind}, not JSON"
                    ) from None
                assert isinstance(row, dict)
                rows.append(row)
            if not rows:
                raise ConfigError(f"environment {self.name!r}: the dataset has no rows")
            self._rows = rows
        return self._rows

    def _make_task(self, index: int, rng: Any) -> TaskRow:
        rows = self.rows()
        row = rows[index % len(rows)]
        prompt = row.get("prompt")
        text = prompt if isinstance(prompt, str) else _text(list(prompt or []))  # type: ignore[arg-type]
        return TaskRow(
            task_id=self.task_id(index),
            environment=self.name,
            prompt=text,
            params={"input": row},
        )

    def task_id(self, index: int) -> str:
        return f"{re.sub(r'[^A-Za-z0-9_-]', '_', self.module)}-{index:04d}"

    def _input(self, task: TaskRow) -> dict[str, Any]:
        row = task.params.get("input")
        if not isinstance(row, dict) or "prompt" not in row:
            raise EpisodeError(
                f"task {task.task_id}: params.input must be a dataset row with a prompt"
            )
        return dict(row)

    # ---- the tool: the policy's turn, then the environment's --------------------------
    def tool_table(self) -> Mapping[str, Tool[VfEpisode, Any]]:
        return self._tools

    def respond(self, episode: VfEpisode, args: RespondArgs) -> str:
        return self._run(self._respond(episode, args.content))

    async def _respond(self, episode: VfEpisode, content: str) -> str:
        vf_env, state = self.vf_env, episode.state
        if episode.finished or await vf_env.is_completed(state):
            raise ToolArgumentError(
                f"{RESPOND_TOOL}: the episode is over ({state.get('stop_condition')});"
                " give your final answer"
            )
        await self._add_turn(episode, content)
        if await vf_env.is_completed(state):
            return f"The episode is over ({state.get('stop_condition')}). Give your final answer."
        before = len(episode.messages) + 1
        episode.messages = list(await vf_env.get_prompt_messages(state))
        reply = _text(episode.messages[before:])
        if state.get("final_env_response") is not None or await vf_env.is_completed(state):
            reply += "\n\nThe episode is over. Give your final answer."
        return reply

    async def _add_turn(self, episode: VfEpisode, content: str) -> None:
        import verifiers as vf

        state = episode.state
        step = {
            "prompt": list(episode.messages),
            "completion": [vf.AssistantMessage(content=content)],
            "response": None,
            "tokens": None,
            "reward": None,
            "advantage": None,
            "is_truncated": False,
            "trajectory_id": state["trajectory_id"],
            "extras": {},
        }
        await self.vf_env.add_trajectory_step(state, step)

    # ---- episodes -----------------------------------------------------------------------
    async def _new_state(self, task: TaskRow) -> Any:
        from verifiers.types import ClientConfig

        # The model is rollpoint's policy, called by the agent: verifiers never calls this
        # client (an address nothing listens on, never connected).
        client = ClientConfig(api_base_url="http://127.0.0.1:9/v1", api_key_var="ROLLPOINT_NONE")
        return await self.vf_env.init_state(self._input(task), client, "rollpoint")

    async def _start(self, task: TaskRow) -> VfEpisode:
        state = await self._new_state(task)
        started = await self.vf_env.setup_state(state)
        if started is not None:
            state = started
        messages = list(await self.vf_env.get_prompt_messages(state))
        return VfEpisode(state=state, messages=messages)

    def start(self, task: TaskRow) -> VfEpisode:
        return self._run(self._start(task))

    async def _verify(self, episode: VfEpisode, final_message: str | None) -> VerifyReply:
        vf_env, state = self.vf_env, episode.state
        if not episode.finished:
            if final_message and not await vf_env.is_completed(state):
                await self._add_turn(episode, final_message)
            episode.finished = True
        await vf_env.render_completion(state)
        rendered = state["prompt"], state["completion"]
        state["prompt"], state["completion"] = _for_rubric(rendered[0]), _for_rubric(rendered[1])
        try:
            await vf_env.rubric.score_rollout(state)
        finally:
            state["prompt"], state["completion"] = rendered
        raw = float(state.get("reward") or 0.0)
        detail: dict[str, Any] = {
            "rubric_reward": raw,
            "metrics": to_json(state.get("metrics") or {}, "metrics"),
            "stop_condition": state.get("stop_condition"),
            "turns": len(state["trajectory"]),
        }
        return VerifyReply(reward=min(1.0, max(0.0, raw)), detail=detail)

    def verify(self, state: VfEpisode, task: TaskRow, final_message: str | None) -> VerifyReply:
        return self._run(self._verify(state, final_message))

    def export_state(self, state: VfEpisode) -> dict[str, JsonValue]:
        vf_state = state.state
        try:
            messages = to_json(state.messages, "messages")
            saved = {
                key: to_json(value, key)
                for key, value in vf_state.items()
                if key not in REBUILT_KEYS
            }
            trajectory = [
                {
                    "prompt_len": len(step["prompt"]),
                    "completion": to_json(step["completion"], "completion"),
                    "reward": to_json(step.get("reward"), "reward"),
                    "advantage": to_json(step.get("advantage"), "advantage"),
                    "is_truncated": bool(step.get("is_truncated")),
                    "extras": to_json(step.get("extras") or {}, f"trajectory[{i}].extras"),
                }
                for i, step in enumerate(vf_state["trajectory"])
            ]
        except NotJson as exc:
            raise EpisodeError(
                f"environment {self.name!r}: state key {exc.where!r} holds a {exc.kind}, which"
                " is not JSON-able: this episode cannot be saved (keep JSON values in the state)"
            ) from None
        return {
            "messages": messages,
            "trajectory": trajectory,  # type: ignore[dict-item]
            "state": saved,
            "finished": state.finished,
        }

    def capture_state(self, state: VfEpisode) -> Callable[[], dict[str, JsonValue]]:
        """The export made now; a state that cannot be saved fails when the snapshot's writer
        packs it (which names the rollout), never in the pause or in the image's sweep."""
        try:
            exported = self.export_state(state)
        except EpisodeError as exc:
            refusal = exc

            def refuse() -> dict[str, JsonValue]:
                raise refusal

            return refuse
        return lambda: exported

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> VfEpisode:
        return self._run(self._restore(task, exported))

    async def _restore(self, task: TaskRow, exported: Mapping[str, Any]) -> VfEpisode:
        from verifiers.utils.message_utils import normalize_messages

        where = f"{self.name} state of task {task.task_id}"
        messages, trajectory, saved = (
            exported.get("messages"),
            exported.get("trajectory"),
            exported.get("state"),
        )
        if not (
            isinstance(messages, list)
            and isinstance(trajectory, list)
            and isinstance(saved, dict)
            and isinstance(exported.get("finished"), bool)
        ):
            raise InvalidCheckpointStateError(
                f"{where}: want {{messages: [...], trajectory: [...], state: {{...}}, finished}}"
            )
        state = await self._new_state(task)
        try:
            conversation = normalize_messages(messages, field_name="messages")
            steps = []
            for step in trajectory:
                steps.append(
                    {
                        "prompt": conversation[: int(step["prompt_len"])],
                        "completion": normalize_messages(
                            step["completion"], field_name="completion"
                        ),
                        "response": None,
                        "tokens": None,
                        "reward": step["reward"],
                        "advantage": step["advantage"],
                        "is_truncated": bool(step["is_truncated"]),
                        "trajectory_id": state["trajectory_id"],
                        "extras": dict(step["extras"]),
                    }
                )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidCheckpointStateError(
                f"{where}: bad trajectory or messages ({exc})"
            ) from None
        for key, value in saved.items():
            if key in REBUILT_KEYS:
                continue
            state[key] = (
                normalize_messages(value, field_name=key)
                if key in _MESSAGE_KEYS and isinstance(value, list)
                else value
            )
        state["trajectory"] = steps
        return VfEpisode(state=state, messages=list(conversation), finished=exported["finished"])

    def close(self, state: VfEpisode) -> None:
        self._run(self.vf_env.cleanup(state.state))
