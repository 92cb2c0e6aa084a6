"""The run config: every bad key or value is one line naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpoint.app.config import load_config, parse_config
from rollpoint.protocol.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", ["workplace.yaml", "blackjack.yaml", "math.yaml"])
def test_every_example_config_loads(name: str) -> None:
    config = load_config(EXAMPLES / name)
    assert config.environment == name.removesuffix(".yaml")


def test_defaults_match_the_documented_keys() -> None:
    config = parse_config({})
    assert (config.environment, config.group_size, config.replicas, config.runtime) == (
        "workplace",
        4,
        2,
        "embedded",
    )
    assert config.policy.base_url is None


def test_unknown_top_level_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'replica'"):
        parse_config({"replica": 2}, source="job.yaml")


def test_unknown_nested_key_is_named_with_its_path() -> None:
    with pytest.raises(ConfigError, match=r"job.yaml: unknown key 'policy.modle'"):
        parse_config({"policy": {"modle": "x"}}, source="job.yaml")


def test_bad_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"key 'group_size'"):
        parse_config({"group_size": 0})


def test_unknown_environment_is_named() -> None:
    with pytest.raises(
        ConfigError,
        match=r"key 'environment': unknown environment 'chess' \(valid: blackjack, math, workplace",
    ):
        parse_config({"environment": "chess"})


def test_non_loopback_host_needs_explicit_flag() -> None:
    with pytest.raises(ConfigError, match="allow_remote_bind"):
        parse_config({"host": "0.0.0.0"})
    assert parse_config({"host": "0.0.0.0", "allow_remote_bind": True}).host == "0.0.0.0"


def test_unreadable_and_invalid_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tasks: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of keys"):
        load_config(listy)


def test_sampling_settings_become_the_fields_of_every_policy_call() -> None:
    config = parse_config(
        {
            "policy": {
                "sampling": {
                    "temperature": 0.6,
                    "top_p": 0.95,
                    "max_tokens": 512,
                    "stop": "</answer>",
                    "logprobs": True,
                    "top_logprobs": 3,
                    "seed": "none",
                    "extra": {"top_k": 40, "chat_template_kwargs": {"enable_thinking": False}},
                },
                "capture_tokens": "required",
                "engine": "sglang",
            }
        }
    )
    assert config.policy.sampling.request_fields() == {
        "top_k": 40,
        "chat_template_kwargs": {"enable_thinking": False},
        "temperature": 0.6,
        "top_p": 0.95,
        "max_tokens": 512,
        "stop": ["</answer>"],
        "logprobs": True,
        "top_logprobs": 3,
    }
    assert (config.policy.capture_tokens, config.policy.engine) == ("required", "sglang")
    assert parse_config({}).policy.sampling.request_fields() == {}


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"temperature": -0.1}, r"key 'policy.sampling.temperature'"),
        ({"top_p": 0}, r"key 'policy.sampling.top_p'"),
        ({"max_tokens": 0}, r"key 'policy.sampling.max_tokens'"),
        ({"stop": [""]}, r"key 'policy.sampling.stop.0'"),
        ({"top_logprobs": 2}, r"top_logprobs needs logprobs: true"),
        ({"seed": "random"}, r"key 'policy.sampling.seed'"),
        ({"extra": {"n": 4}}, r"extra.n is set by rollpoint"),
        ({"extra": {"temperature": 1}}, r"extra.temperature is set by rollpoint"),
        ({"temprature": 1}, r"unknown key 'policy.sampling.temprature'"),
    ],
)
def test_bad_sampling_settings_are_named(sampling: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"policy": {"sampling": sampling}}, source="job.yaml")


def test_capture_tokens_takes_a_bool_or_required() -> None:
    with pytest.raises(ConfigError, match=r"key 'policy.capture_tokens'"):
        parse_config({"policy": {"capture_tokens": "always"}})


def test_metrics_port_and_host_are_validated_and_named() -> None:
    config = parse_config({"metrics": {"port": 9464}})
    assert (config.metrics.port, config.metrics_host) == (9464, "127.0.0.1")
    with pytest.raises(ConfigError, match=r"key 'metrics.port'"):
        parse_config({"metrics": {"port": 70000}})
    with pytest.raises(ConfigError, match=r"unknown key 'metrics.prot'"):
        parse_config({"metrics": {"prot": 1}})
    with pytest.raises(ConfigError, match=r"metrics.host '0.0.0.0' is not loopback"):
        parse_config({"metrics": {"host": "0.0.0.0"}})
    opened = parse_config({"metrics": {"host": "0.0.0.0"}, "allow_remote_bind": True})
    assert opened.metrics_host == "0.0.0.0"


def test_journal_snapshots_need_the_journal_and_the_cut_stays_the_default() -> None:
    assert parse_config({}).snapshot.mode == "cut"
    with pytest.raises(
        ConfigError, match=r"job.yaml: key 'snapshot.mode': 'journal' needs journal"
    ):
        parse_config({"snapshot": {"mode": "journal"}}, source="job.yaml")
    config = parse_config({"snapshot": {"mode": "journal"}, "journal": {"enabled": True}})
    assert config.trainer_settings().save.mode == "journal"
    with pytest.raises(ConfigError, match=r"key 'snapshot.mode'"):
        parse_config({"snapshot": {"mode": "pausefree"}})
