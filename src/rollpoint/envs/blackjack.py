"""The ``blackjack`` environment: Gymnasium's ``Blackjack-v1`` behind three tools.

Owns the game per episode (the real Gymnasium env with the env class's default rules,
``natural=False`` and ``sab=False``, passed on purpose: the ``Blackjack-v1`` registration
defaults to ``sab=True``), the tool replies, the reward mapping (win 1.0, draw 0.5, lose 0.0) and an
exact export: both hands, the face-up card's display and the env's PCG64 bit-generator
state, so a restored game deals the very same next cards. Each tool answers JSON
``{"player_sum", "dealer_card", "usable_ace", "done", "outcome"}``.

Gymnasium and numpy come with the ``gym`` extra: the class imports without them (the
registry lists every built-in), and building one without them is a one-line ConfigError.

Prompt (parsed by the scripted policy, keep it character for character)::

    Play one hand of blackjack. Call blackjack_status to see your hand, then blackjack_hit or blackjack_stand until the hand is over.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import Field, JsonValue, ValidationError

from rollpoint.common.extras import need
from rollpoint.envs.base import Environment, NoArguments, Tool, ToolArgumentError
from rollpoint.protocol.episode import TaskRow, VerifyReply
from rollpoint.protocol.errors import EpisodeError, InvalidCheckpointStateError
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import CheckpointMode

if TYPE_CHECKING:
    import numpy as np

BLACKJACK_PROMPT = (
    "Play one hand of blackjack. Call blackjack_status to see your hand, "
    "then blackjack_hit or blackjack_stand until the hand is over."
)
_HIT, _STICK = 1, 0


class Outcome(StrEnum):
    WIN = "win"
    LOSE = "lose"
    DRAW = "draw"


_REWARD = {Outcome.WIN: 1.0, Outcome.DRAW: 0.5, Outcome.LOSE: 0.0}


def _outcome(env_reward: float) -> Outcome:
    if env_reward > 0:
        return Outcome.WIN
    return Outcome.DRAW if env_reward == 0 else Outcome.LOSE


class BlackjackParams(StrictModel):
    seed: Annotated[int, Field(ge=0, lt=2**63)]


Card = Annotated[int, Field(ge=1, le=10)]


class _RngState(StrictModel):
    """numpy's PCG64 state; the 128-bit integers travel as decimal strings (JSON-safe)."""

    bit_generator: str
    state: str
    inc: str
    has_uint32: int
    uinteger: int


class _ExportedGame(StrictModel):
    player: list[Card] = Field(min_length=2)
    dealer: list[Card] = Field(min_length=2)
    dealer_top_card_suit: str
    dealer_top_card_value_str: str
    rng: _RngState
    outcome: Outcome | None


@dataclass
class BlackjackState:
    """One hand: the Gymnasium env (wrappers included) and how the hand ended, if it did."""

    env: Any
    outcome: Outcome | None = None

    @property
    def game(self) -> Any:
        """The unwrapped ``BlackjackEnv``, whose attributes are the game state."""
        return self.env.unwrapped


def _params(task: TaskRow) -> BlackjackParams:
    try:
        return BlackjackParams.model_validate(task.params)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise EpisodeError(f"task {task.task_id}: bad params at '{loc}': {err['msg']}") from None


def _new_game(seed: int) -> Any:
    import gymnasium as gym

    env = gym.make("Blackjack-v1", natural=False, sab=False)
    env.reset(seed=seed)
    return env


def _status(state: BlackjackState) -> str:
    player_sum, dealer_card, usable_ace = state.game._get_obs()
    reply: dict[str, JsonValue] = {
        "player_sum": int(player_sum),
        "dealer_card": int(dealer_card),
        "usable_ace": bool(usable_ace),
        "done": state.outcome is not None,
        "outcome": state.outcome.value if state.outcome is not None else None,
    }
    return json.dumps(reply)


def _act(state: BlackjackState, action: int, tool: str) -> str:
    if state.outcome is not None:
        raise ToolArgumentError(
            f"{tool}: the hand is over (you {state.outcome.value}); give your final answer"
        )
    _, reward, terminated, _, _ = state.env.step(action)
    if terminated:
        state.outcome = _outcome(float(reward))
    return _status(state)


def _status_tool(state: BlackjackState, _: NoArguments) -> str:
    return _status(state)


def _hit_tool(state: BlackjackState, _: NoArguments) -> str:
    return _act(state, _HIT, "blackjack_hit")


def _stand_tool(state: BlackjackState, _: NoArguments) -> str:
    return _act(state, _STICK, "blackjack_stand")


_TOOLS: dict[str, Tool[BlackjackState, Any]] = {
    tool.name: tool
    for tool in (
        Tool(
            "blackjack_status",
            "Show your hand total, the dealer's face-up card and whether the hand is over.",
            NoArguments,
            _status_tool,
        ),
        Tool(
            "blackjack_hit",
            "Take one more card.",
            NoArguments,
            _hit_tool,
        ),
        Tool(
            "blackjack_stand",
            "Stop taking cards; the dealer plays and the hand is scored.",
            NoArguments,
            _stand_tool,
        ),
    )
}


class BlackjackEnvironment(Environment[BlackjackState]):
    """One hand of blackjack per episode, on the real Gymnasium environment."""

    name: ClassVar[str] = "blackjack"
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.TURN
    reproducible_start: ClassVar[bool] = True  # the deal is seeded by the task

    def __init__(self) -> None:
        # Here, not at the first deal: a job builds one to make its tasks, before any server.
        need("gym", "the blackjack environment")
        super().__init__()

    def _make_task(self, index: int, rng: random.Random) -> TaskRow:
        return TaskRow(
            task_id=self.task_id(index),
            environment="blackjack",
            prompt=BLACKJACK_PROMPT,
            params={"seed": rng.randrange(2**31)},
        )

    def tool_table(self) -> Mapping[str, Tool[BlackjackState, Any]]:
        return _TOOLS

    def start(self, task: TaskRow) -> BlackjackState:
        return BlackjackState(env=_new_game(_params(task).seed))

    def verify(
        self, state: BlackjackState, task: TaskRow, final_message: str | None
    ) -> VerifyReply:
        game = state.game
        detail: dict[str, Any] = {
            "outcome": state.outcome.value if state.outcome is not None else None,
            "player": list(game.player),
            "dealer": list(game.dealer),
        }
        reward = _REWARD[state.outcome] if state.outcome is not None else 0.0
        return VerifyReply(reward=reward, detail=detail)

    def export_state(self, state: BlackjackState) -> dict[str, JsonValue]:
        game = state.game
        rng = game.np_random.bit_generator.state
        return {
            "player": [int(c) for c in game.player],
            "dealer": [int(c) for c in game.dealer],
            "dealer_top_card_suit": str(game.dealer_top_card_suit),
            "dealer_top_card_value_str": str(game.dealer_top_card_value_str),
            "rng": {
                "bit_generator": rng["bit_generator"],
                "state": str(rng["state"]["state"]),
                "inc": str(rng["state"]["inc"]),
                "has_uint32": int(rng["has_uint32"]),
                "uinteger": int(rng["uinteger"]),
            },
            "outcome": state.outcome.value if state.outcome is not None else None,
        }

    def restore_state(self, task: TaskRow, exported: Mapping[str, Any]) -> BlackjackState:
        seed = _params(task).seed
        try:
            saved = _ExportedGame.model_validate(exported)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise InvalidCheckpointStateError(
                f"blackjack state of task {task.task_id}: '{loc}': {err['msg']}"
            ) from None
        # reset() first: the wrappers insist on it before any step.
        env = _new_game(seed)
        game = env.unwrapped
        game.player = list(saved.player)
        game.dealer = list(saved.dealer)
        game.dealer_top_card_suit = saved.dealer_top_card_suit
        game.dealer_top_card_value_str = saved.dealer_top_card_value_str
        game.np_random = _generator(task, saved.rng)
        return BlackjackState(env=env, outcome=saved.outcome)


def _generator(task: TaskRow, saved: _RngState) -> np.random.Generator:
    if saved.bit_generator != "PCG64":
        raise InvalidCheckpointStateError(
            f"blackjack state of task {task.task_id}: bit generator {saved.bit_generator!r},"
            " want 'PCG64'"
        )
    import numpy as np

    bit_generator = np.random.PCG64()
    try:
        bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": int(saved.state), "inc": int(saved.inc)},
            "has_uint32": saved.has_uint32,
            "uinteger": saved.uinteger,
        }
    except (ValueError, TypeError) as exc:
        raise InvalidCheckpointStateError(
            f"blackjack state of task {task.task_id}: bad generator state ({exc})"
        ) from None
    return np.random.Generator(bit_generator)
