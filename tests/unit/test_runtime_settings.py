"""The runtimes' settings: what ``rollpoint run``'s config tells them (the runtimes read no
config), and the replica plan made from them."""

from __future__ import annotations

from pathlib import Path

from rollpoint.app.config import parse_config
from rollpoint.runtime.replica_plan import ReplicaPlan
from rollpoint.runtime.settings import PolicySettings, RaySettings, RuntimeSettings


def test_a_run_config_tells_the_runtime_each_of_its_keys(tmp_path: Path) -> None:
    config = parse_config(
        {
            "workdir": str(tmp_path),
            "environment": "math",
            "replicas": 3,
            "runtime": "ray",
            "base_port": 31000,
            "seed": 7,
            "agent_loop": "sandbox_env.summary_loop:SummarizingLoop",
            "upstream_connections": 5,
            "final_states_log": str(tmp_path / "final"),
            "journal": {"enabled": True, "window_ms": 4},
            "policy": {
                "base_url": "http://127.0.0.1:9/v1",
                "model": "m",
                "api_key": "k",
                "engine": "sglang",
                "capture_tokens": "required",
                "generation_cut": False,
                "sampling": {"temperature": 0.5, "seed": "turn"},
                "latency_ms": 3,
                "error_rate": 0.5,
                "tokens_per_call": 11,
                "tool_turns": 2,
                "call_log": str(tmp_path / "calls.jsonl"),
                "weights_log": str(tmp_path / "weights.jsonl"),
                "token_latency_ms": 1.5,
                "reasoning_tokens": 4,
            },
            "ray": {"address": "ray://h:10001", "num_cpus_per_replica": 0.5, "forward_env": ["X"]},
        }
    )
    assert config.runtime_settings() == RuntimeSettings(
        workdir=tmp_path,
        environment="math",
        replicas=3,
        runtime="ray",
        base_port=31000,
        seed=7,
        agent_loop="sandbox_env.summary_loop:SummarizingLoop",
        upstream_connections=5,
        final_states_log=tmp_path / "final",
        journal_window_s=0.004,
        policy=PolicySettings(
            base_url="http://127.0.0.1:9/v1",
            model="m",
            api_key="k",
            engine="sglang",
            capture_tokens="required",
            generation_cut=False,
            sampling={"temperature": 0.5},
            seed="turn",
            latency_ms=3,
            error_rate=0.5,
            tokens_per_call=11,
            tool_turns=2,
            call_log=tmp_path / "calls.jsonl",
            weights_log=tmp_path / "weights.jsonl",
            token_latency_ms=1.5,
            reasoning_tokens=4,
        ),
        ray=RaySettings(address="ray://h:10001", num_cpus_per_replica=0.5, forward_env=("X",)),
    )


def test_the_defaults_are_the_configs(tmp_path: Path) -> None:
    config = parse_config({"workdir": str(tmp_path)})
    assert config.runtime_settings() == RuntimeSettings(workdir=tmp_path)


def test_the_replica_plan_carries_the_settings(tmp_path: Path) -> None:
    config = parse_config(
        {
            "workdir": str(tmp_path),
            "journal": {"enabled": True, "window_ms": 4},
            "upstream_connections": 5,
            "policy": {"capture_tokens": True, "sampling": {"top_p": 0.5, "seed": "none"}},
        }
    )
    plan = ReplicaPlan.of(
        config.runtime_settings(), policy_url="http://127.0.0.1:9/v1", snapshot_root="/s"
    )
    assert (plan.environment, plan.builtin_policy, plan.model_name) == (
        "workplace",
        True,
        "scripted",
    )
    assert (plan.sampling, plan.seed_policy, plan.capture_tokens) == ({"top_p": 0.5}, "none", True)
    assert (plan.generation_cut, plan.journal_window_s, plan.upstream_connections) == (
        True,
        0.004,
        5,
    )
