"""The generic playbook: any environment, from the tool specs of the request alone."""

from __future__ import annotations

import random
from datetime import date
from typing import Annotated, Any, Literal

import orjson
import pytest
from pydantic import BaseModel, Field, ValidationError

from rollpoint.envs import NoArguments, Tool, ToolArguments
from rollpoint.policy.playbook import Playbook, ToolCallDecision
from rollpoint.policy.schema_arguments import sample_arguments
from tests.unit.policy.fake_environments import request, run_episode


class Inner(ToolArguments):
    label: Annotated[str, Field(min_length=2, max_length=5)]
    weight: Annotated[float, Field(gt=0, lt=1)]


class Everything(ToolArguments):
    path: Annotated[str, Field(pattern=r"^[a-z0-9_]{1,8}\.txt$")]
    count: Annotated[int, Field(ge=3, le=7)]
    step: Annotated[int, Field(ge=0, le=100, multiple_of=5)]
    mode: Literal["a", "b"]
    on: bool
    when: date
    tags: Annotated[list[str], Field(min_length=1, max_length=3)]
    inner: Inner
    maybe: int | None = None
    fixed: Literal["only"] = "only"
    many: list[Inner] = []


SCHEMAS: list[type[BaseModel]] = [Everything, Inner, NoArguments]


def _json_strict(model: type[BaseModel], args: dict[str, Any]) -> BaseModel:
    # What the resources server does: JSON arguments into a strict pydantic model.
    return model.model_validate_json(orjson.dumps(args))


@pytest.mark.parametrize("model", SCHEMAS)
def test_sampled_arguments_are_valid_for_their_schema(model: type[BaseModel]) -> None:
    schema = model.model_json_schema()
    seen = set()
    for seed in range(200):
        args = sample_arguments(schema, random.Random(seed))
        _json_strict(model, args)  # raises on the first invalid draw
        seen.add(orjson.dumps(args, option=orjson.OPT_SORT_KEYS))
    # Seeded draws, not one fixed value (NoArguments has only one valid value: {}).
    assert len(seen) == (1 if model is NoArguments else 200)


def test_the_same_rng_gives_the_same_arguments() -> None:
    schema = Everything.model_json_schema()
    assert sample_arguments(schema, random.Random(7)) == sample_arguments(schema, random.Random(7))


class Counter:
    """A third-party-like environment the policy has no playbook for."""

    class Add(ToolArguments):
        amount: Annotated[int, Field(ge=1, le=9)]
        note: Annotated[str, Field(max_length=6)] = ""

    def __init__(self) -> None:
        self.total = 0
        self.tools = [
            Tool("counter_add", "Add to the counter", Counter.Add, self._add),
            Tool("counter_show", "Show the counter", NoArguments, lambda s, a: str(self.total)),
        ]

    def _add(self, state: object, args: Counter.Add) -> str:
        self.total += args.amount
        return str(self.total)

    def specs(self) -> list[dict[str, Any]]:
        return [t.spec() for t in self.tools]

    def __call__(self, name: str, arguments: str) -> str:
        tool = next((t for t in self.tools if t.name == name), None)
        if tool is None:
            return f"error: unknown tool {name}"
        try:
            args = tool.arguments.model_validate_json(arguments or "{}")
        except ValidationError as exc:
            return f"error: {exc.errors()[0]['msg']}"
        return tool.run(None, args)


@pytest.mark.parametrize("tool_turns", [1, 4])
def test_it_makes_the_configured_number_of_tool_turns_then_answers(tool_turns: int) -> None:
    env = Counter()
    playbook = Playbook(seed=3, error_rate=0.0, tool_turns=tool_turns)
    episode = run_episode(
        playbook, prompt="Count things.", tools=env.specs(), environment=env, seed=11
    )
    assert len(episode.calls) == tool_turns
    assert episode.final is not None and episode.final.startswith(f"Done: {tool_turns} tool")
    for call in episode.calls:
        assert call.mistake is None
        assert not env(call.name, call.arguments).startswith("error")  # schema-valid


def test_episodes_are_seeded_and_reproducible() -> None:
    def play(seed: int) -> list[tuple[str, str]]:
        env = Counter()
        playbook = Playbook(seed=0, error_rate=0.0, tool_turns=6)
        episode = run_episode(
            playbook, prompt="Count things.", tools=env.specs(), environment=env, seed=seed
        )
        return [(c.name, c.arguments) for c in episode.calls]

    assert play(1) == play(1)
    assert play(1) != play(2)


def test_blunders_are_wrong_calls_the_environment_refuses() -> None:
    env = Counter()
    playbook = Playbook(seed=0, error_rate=1.0, tool_turns=8)
    episode = run_episode(
        playbook, prompt="Count things.", tools=env.specs(), environment=env, seed=5
    )
    assert len(episode.calls) == 8
    assert all(isinstance(c, ToolCallDecision) and c.mistake is not None for c in episode.calls)
    refused = [c for c in episode.calls if env(c.name, c.arguments).startswith("error")]
    assert refused  # most blunders are refused (a dropped optional argument is not)
    assert {c.name for c in episode.calls if c.name not in ("counter_add", "counter_show")} <= {
        "counter_delete_everything"
    }


def test_no_tools_offered_is_a_final_answer() -> None:
    playbook = Playbook(seed=0, tool_turns=3)
    episode = run_episode(playbook, prompt="Say hi.", tools=None, environment=Counter())
    assert episode.calls == [] and episode.final is not None


def test_a_tool_spec_without_parameters_is_called_with_no_arguments() -> None:
    spec = {"type": "function", "function": {"name": "ping"}}
    decision = Playbook(tool_turns=1).decide(request([{"role": "user", "content": "go"}], [spec]))
    assert isinstance(decision, ToolCallDecision) and decision.name == "ping"
    assert decision.arguments == "{}"
