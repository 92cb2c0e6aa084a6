"""The math playbook: the number only, wrong with probability ``error_rate``."""

from __future__ import annotations

import pytest

from rollpoint.policy.playbook import FinalDecision, Playbook
from tests.unit.policy.fake_environments import ask

PERFECT = Playbook(seed=0, error_rate=0.0)


def answer(playbook: Playbook, question: str, **fields: object) -> str:
    prompt = f"What is {question}? Answer with the number only."
    decision = ask(playbook, [{"role": "user", "content": prompt}], None, **fields)
    assert isinstance(decision, FinalDecision)
    return decision.text


@pytest.mark.parametrize(
    ("question", "expected"),
    [
        ("17 * 23", "391"),
        ("17 + 23", "40"),
        ("17 - 23", "-6"),
        ("-4 * -5", "20"),
        ("5 - -3", "8"),
        ("84 / 4", "21"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("17 % 5", "2"),
        ("2 ** 10", "1024"),
        ("1.5 + 2.25", "3.75"),
    ],
)
def test_answer_is_the_number_only(question: str, expected: str) -> None:
    assert answer(PERFECT, question) == expected


def test_question_with_a_system_message_first() -> None:
    messages = [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": [{"type": "text", "text": "What is 6 * 7?"}]},
    ]
    decision = ask(PERFECT, messages, None)
    assert isinstance(decision, FinalDecision) and decision.text == "42"


def test_error_rate_one_gives_a_wrong_number() -> None:
    always_wrong = Playbook(seed=0, error_rate=1.0)
    for seed in range(30):
        text = answer(always_wrong, "17 * 23", seed=seed)
        assert text.lstrip("-").isdigit()
        assert text != "391"


def test_error_rate_between_gives_both_right_and_wrong_answers() -> None:
    sometimes = Playbook(seed=0, error_rate=0.5)
    answers = {answer(sometimes, "17 * 23", seed=seed) for seed in range(40)}
    assert "391" in answers and len(answers) > 1


@pytest.mark.parametrize(
    "question", ["1 / 0", "5 % 0", "2 ** 100000", "9" * 4000 + " ** 64", "the meaning of life"]
)
def test_question_without_an_answer_gets_a_polite_message(question: str) -> None:
    text = answer(PERFECT, question)
    assert not text.lstrip("-").isdigit()
    assert len(text) > 10
