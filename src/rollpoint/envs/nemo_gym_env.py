"""The ``nemo-gym:<url>@<rows.jsonl>`` environments: a NeMo-Gym resources server over HTTP.

Owns the reference, the task rows, one NeMo-Gym session per episode (the cookie the server
sets at ``/seed_session``), the server's tools, and the saved form of an episode. rollpoint
plays the part NeMo-Gym's agent server plays (``responses_api_agents/simple_agent``), on the
routes and bodies recorded from NeMo-Gym's public source in ``tests/fixtures/nemo_gym``:

- **Reference**: ``nemo-gym:http://host:port@<rows.jsonl>`` names a running resources
  server and a JSONL file of NeMo-Gym task rows (the server's ``data/*.jsonl``: each row a
  ``responses_create_params`` with ``input`` and ``tools``, plus the server's own fields).
  ``@restart`` (a server not deterministic from its row) is the other mode; ``@replay`` is
  the default. The reference is a task row's ``environment``, so the path holds only
  letters, digits, ``_ . / -``.
- **Tasks**: row ``i`` (wrapping around) is task ``i``: its user messages are the prompt, the
  row itself is ``params["row"]``.
- **Tools** are the function tools of the first row's ``responses_create_params.tools``; a
  call is ``POST /<tool name>`` with the arguments as the JSON body and the episode's
  cookie, and the reply body is the tool result. A 4xx reply (FastAPI's 422 for arguments
  that do not validate) is the model's error and no step; a 5xx or a lost connection is the
  episode's error.
- **Episodes**: ``POST /seed_session`` with the row starts a session; ``POST /verify`` with
  the row plus a Responses API ``response`` built from the episode (each call as a
  ``function_call`` and its ``function_call_output``, the final answer as a ``message``) gives
  the reward (clamped to [0, 1]) and ends the session; ``POST /close_session`` ends one that
  was not verified.
- **Saved** (``replay``, ``turn`` mode): ``{"calls", "replayed", "restarts"}``, every call as
  ``[tool, arguments, reply]``. A restore seeds a new session with the row and replays the
  calls, each reply checked against the recorded one; a mismatch is one logged line, and the
  episode restarts on a fresh session (its next tool result says so, its verify detail counts
  ``restarts``). ``@restart``: every restore restarts the episode, reported the same way.

Not here: NeMo-Gym's own checkpoint control plane (``/ng-control/v1/checkpoint/*``, its
``exported`` sessions' ``export_session_states``/``restore_session_states`` hooks) belongs to
NeMo-Gym's coordinator; rollpoint saves what it sent and replays it. A server whose sessions
outlive a crash (the ``external`` mode of the effects work) would skip the replay.

The HTTP client is httpx's (one client, so one cookie jar, per episode); the tool runs in a
worker thread (:func:`~rollpoint.envs.tool_call.slow_tool`).
"""

from __future__ import annotations

import functools
import logging
import random
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar

import httpx
import orjson
from pydantic import ConfigDict, Field, JsonValue

from rollpoint.envs.action_replay import Replay, read_saved, restart_notice
from rollpoint.envs.base import Environment, Tool, ToolArgumentError, ToolArguments
from rollpoint.envs.tool_call import slow_tool
from rollpoint.protocol.episode import TaskRow, VerifyReply
from rollpoint.protocol.errors import ConfigError, EpisodeError
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import CheckpointMode

PREFIX = "nemo-gym:"
_REFERENCE = re.compile(
    r"^nemo-gym:(?P<url>https?://[\w.:-]+(?:/[\w./-]*)?)@(?P<tasks>[\w./-]+?)"
    r"(?:@(?P<mode>replay|restart))?$"
)
"""Within what a task row's ``environment`` may hold: no spaces, no ``;`` or ``=``."""
_TIMEOUT_S = 60.0
SESSION_ROUTES = frozenset({"seed_session", "verify", "close_session", "aggregate_metrics", "mcp"})
"""Routes of a NeMo-Gym resources server that are not tools."""

log = logging.getLogger(__name__)


def read_rows(path: Path, ref: str) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"environment {ref!r}: cannot read tasks file {path}: {exc}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"environment {ref!r}: {path} line {number}: {exc}") from None
        params = row.get("responses_create_params") if isinstance(row, dict) else None
        if not isinstance(params, dict) or not isinstance(params.get("input"), list | str):
            raise ConfigError(
                f"environment {ref!r}: {path} line {number}: not a NeMo-Gym row"
                " (want responses_create_params with input)"
            )
        rows.append(row)
    if not rows:
        raise ConfigError(f"environment {ref!r}: {path} holds no task rows")
    return rows


@functools.cache
def nemo_gym_environment(ref: str) -> type[NemoGymEnvironment]:
    """The environment class ``nemo-gym:<url>@<rows.jsonl>[@replay|@restart]`` names."""
    match = _REFERENCE.match(ref)
    if match is None:
        raise ConfigError(
            f"environment {ref!r}: want nemo-gym:http://host:port@<rows.jsonl>, optionally"
            " followed by @replay or @restart (the path of letters, digits, _ . / -)"
        )
    attrs = {
        "name": ref,
        "url": match["url"].rstrip("/"),
        "tasks_file": match["tasks"],
        "replay": match["mode"] != "restart",
        "__module__": __name__,
        "__doc__": f"The NeMo-Gym resources server at {match['url']}.",
    }
    return type(f"NemoGym[{match['url']}]", (NemoGymEnvironment,), attrs)


class _Arguments(ToolArguments):
    """A tool call's arguments as the model sent them; the server validates them."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


@dataclass(frozen=True)
class _RouteTool(Tool[Any, _Arguments]):
    """A resources server's tool route, with the row's function schema."""

    parameters: dict[str, JsonValue] = field(default_factory=dict)

    def spec(self) -> dict[str, JsonValue]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def parse(self, arguments: Mapping[str, Any]) -> _Arguments:
        return _Arguments.model_validate(dict(arguments))


Call = tuple[str, dict[str, JsonValue], str]
"""One tool call as it happened: the tool, its arguments, the server's reply body."""


class _Saved(StrictModel):
    calls: list[tuple[str, dict[str, JsonValue], str]]
    replayed: Annotated[int, Field(ge=0)]
    restarts: Annotated[int, Field(ge=0)]


@dataclass
class NemoGymEpisode:
    """One episode: its session (an httpx client holding the cookie) and its calls."""

    client: httpx.Client
    calls: list[Call] = field(default_factory=list)
    replayed: int = 0
    restarts: int = 0
    notice: str | None = None
    verified: bool = False


class NemoGymEnvironment(Environment[NemoGymEpisode]):
    """A NeMo-Gym resources server; :func:`nemo_gym_environment` makes one class per reference."""

    name: ClassVar[str] = "nemo-gym"
    url: ClassVar[str] = ""
    tasks_file: ClassVar[str] = ""
    replay: ClassVar[bool] = True
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.TURN

    def __init__(self) -> None:
        if not self.url or not self.tasks_file:
            raise ConfigError(f"environment {self.name!r}: no url or tasks file")
        super().__init__()
        self.rows = read_rows(Path(self.tasks_file), self.name)
        self._tools: dict[str, Tool[NemoGymEpisode, Any]] = {}
        for spec in self.rows[0]["responses_create_params"].get("tools") or ():
            name = spec.get("name") if isinstance(spec, dict) else None
            if not isinstance(name, str) or spec.get("type", "function") != "function":
                continue
            if name in SESSION_ROUTES:
                raise ConfigError(f"environment {self.name!r}: tool {name!r} is a session route")
            self._tools[name] = _RouteTool(
                name,
                spec.get("description") or "",
                _Arguments,
                slow_tool(functools.partial(self._call, name)),
                spec.get("parameters") or {"type": "object", "properties": {}},
            )

    # ---- tasks --------------------------------------------------------------------------
    def _make_task(self, index: int, rng: random.Random) -> TaskRow:
        row = self.rows[index % len(self.rows)]
        return TaskRow(
            task_id=self.task_id(index),
            environment=self.name,
            prompt=self.prompt(row),
            params={"row": row},
        )

    def task_id(self, index: int) -> str:
        return f"nemo-gym-{index:04d}"

    @staticmethod
    def prompt(row: Mapping[str, Any]) -> str:
        given = row["responses_create_params"]["input"]
        if isinstance(given, str):
            return given
        return "\n\n".join(
            str(m.get("content")) for m in given if isinstance(m, dict) and m.get("role") == "user"
        )

    # ---- the session --------------------------------------------------------------------
    def _where(self, task: TaskRow) -> str:
        return f"{self.name}: task {task.task_id}"

    def _post(self, client: httpx.Client, route: str, body: Any, where: str) -> httpx.Response:
        try:
            return client.post(f"{self.url}/{route}", content=orjson.dumps(body))
        except httpx.HTTPError as exc:
            raise EpisodeError(f"{where}: POST {self.url}/{route} failed: {exc}") from None

    def _seed(self, task: TaskRow) -> httpx.Client:
        client = httpx.Client(timeout=_TIMEOUT_S, headers={"content-type": "application/json"})
        reply = self._post(client, "seed_session", _row(task), self._where(task))
        if reply.status_code != 200:
            client.close()
            raise EpisodeError(
                f"{self._where(task)}: /seed_session answered {reply.status_code}: {reply.text[:300]}"
            )
        return client

    def tool_table(self) -> Mapping[str, Tool[NemoGymEpisode, Any]]:
        return self._tools

    def _call(self, tool: str, state: NemoGymEpisode, args: _Arguments) -> str:
        if state.verified:
            raise ToolArgumentError(f"{tool}: the episode is over; give your final answer")
        arguments: dict[str, JsonValue] = dict(args.model_extra or {})
        reply = self._post(state.client, tool, arguments, self.name)
        if 400 <= reply.status_code < 500:
            raise ToolArgumentError(f"{tool}: {reply.status_code} {reply.text[:500]}")
        if reply.status_code != 200:
            raise EpisodeError(f"{self.name}: /{tool} answered {reply.status_code}")
        state.calls.append((tool, arguments, reply.text))
        if state.notice is not None:
            notice, state.notice = state.notice, None
            return f"{reply.text}\n\n[{notice}]"
        return reply.text

    # ---- episodes -----------------------------------------------------------------------
    def start(self, task: TaskRow) -> NemoGymEpisode:
        return NemoGymEpisode(client=self._seed(task))

    def response(self, state: NemoGymEpisode, final_message: str | None) -> dict[str, JsonValue]:
        """The episode as the Responses API ``response`` NeMo-Gym's ``/verify`` reads."""
        return responses_api_response(state.calls, final_message)

    def verify(
        self, state: NemoGymEpisode, task: TaskRow, final_message: str | None
    ) -> VerifyReply:
        where = self._where(task)
        reply = self._post(
            state.client,
            "verify",
            {**_row(task), "response": self.response(state, final_message)},
            where,
        )
        if reply.status_code != 200:
            raise EpisodeError(f"{where}: /verify answered {reply.status_code}: {reply.text[:300]}")
        state.verified = True
        reward = orjson.loads(reply.content).get("reward")
        if not isinstance(reward, int | float):
            raise EpisodeError(f"{where}: /verify gave no reward")
        detail: dict[str, Any] = {
            "reward": reward,
            "calls": len(state.calls),
            "replayed": state.replayed,
            "restarts": state.restarts,
        }
        return VerifyReply(reward=min(1.0, max(0.0, float(reward))), detail=detail)

    def export_state(self, state: NemoGymEpisode) -> dict[str, JsonValue]:
        return {
            "calls": [[tool, dict(args), reply] for tool, args, reply in state.calls],
            "replayed": state.replayed,
            "restarts": state.restarts,
        }

    def side_effects(self, state: NemoGymEpisode) -> Counter[str]:
        return Counter(
            f"call {i + 1}: {tool} {orjson.dumps(args, option=orjson.OPT_SORT_KEYS).decode()}"
            for i, (tool, args, _) in enumerate(state.calls)
        )

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> NemoGymEpisode:
        saved = read_saved(_Saved, exported, self.name, task)
        where = self._where(task)
        client = self._seed(task)
        replay = Replay(
            where,
            saved.calls,
            [recorded for _, _, recorded in saved.calls],
            shows=lambda call: f"{call[0]} answered",
            step="call",
            restarts="on a new session",
        )
        if self.replay:
            for tool, arguments, _ in replay:
                reply = self._post(client, tool, arguments, where)
                # Any other status is no recorded reply (those were 200s): never equal.
                ok = reply.status_code == 200
                replay.answered(reply.text if ok else (reply.status_code, reply.text))
            if replay.diverged is None:
                return NemoGymEpisode(
                    client=client,
                    calls=[(t, a, r) for t, a, r in saved.calls],
                    replayed=saved.replayed + replay.replayed,
                    restarts=saved.restarts,
                )
            log.warning("%s", replay.diverged)
            self._post(client, "close_session", {}, where)
            client.close()
            client = self._seed(task)
        else:
            log.warning("%s: restarts on a new session (@restart)", where)
        return NemoGymEpisode(
            client=client,
            replayed=saved.replayed + replay.replayed,
            restarts=saved.restarts + 1,
            notice=restart_notice("its task", "call"),
        )

    def close(self, state: NemoGymEpisode) -> None:
        try:
            if not state.verified:
                state.client.post(f"{self.url}/close_session", content=b"{}")
        except httpx.HTTPError as exc:  # the server reaps it or is gone
            log.debug("closing a NeMo-Gym session: %s", exc)
        finally:
            state.client.close()


def _row(task: TaskRow) -> dict[str, Any]:
    row = task.params.get("row")
    if not isinstance(row, dict):
        raise EpisodeError(f"task {task.task_id}: params has no NeMo-Gym row")
    return row


def responses_api_response(calls: list[Call], final_message: str | None) -> dict[str, JsonValue]:
    """Calls and a final answer as the Responses API ``response`` NeMo-Gym's ``/verify``
    reads: each call a ``function_call`` and its ``function_call_output``, the answer a
    ``message`` (the shapes of ``tests/fixtures/nemo_gym/counter_verify_response.json``)."""
    output: list[JsonValue] = []
    for index, (tool, arguments, reply) in enumerate(calls):
        call_id = f"call_{index}"
        output.append(
            {
                "type": "function_call",
                "call_id": call_id,
                "name": tool,
                "arguments": orjson.dumps(arguments).decode(),
                "id": f"fc_{index}",
                "status": "completed",
            }
        )
        output.append({"type": "function_call_output", "call_id": call_id, "output": reply})
    output.append(
        {
            "type": "message",
            "id": "msg_final",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": final_message or "", "annotations": []}],
        }
    )
    return {
        "id": "resp_rollpoint",
        "created_at": 0.0,
        "model": "rollpoint",
        "object": "response",
        "output": output,
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
    }
