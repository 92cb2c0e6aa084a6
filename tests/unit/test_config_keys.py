"""Config keys by name: "did you mean" for a typo, and the docs name only keys that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rollpoint.app.config import RunConfig, parse_config
from rollpoint.app.config_keys import config_keys, did_you_mean
from rollpoint.protocol.errors import ConfigError

DOCS = Path(__file__).resolve().parents[2] / "docs"
KEYS = set(config_keys(RunConfig))
SECTIONS = sorted(k for k in KEYS if "." not in k and f"{k}." in "|".join(KEYS))


@pytest.mark.parametrize(
    ("data", "said"),
    [
        ({"replica": 3}, "unknown key 'replica' (did you mean 'replicas'?)"),
        (
            {"snapshot": {"every_second": 1}},
            "unknown key 'snapshot.every_second' (did you mean 'every_seconds'?)",
        ),
        ({"policy": {"sampling": {"temprature": 1}}}, "(did you mean 'temperature'?)"),
        ({"failure": {"max_failed_fractio": 0.2}}, "(did you mean 'max_failed_fraction'?)"),
    ],
)
def test_an_unknown_key_names_the_closest_one(data: dict[str, object], said: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(data)
    assert said in refused.value.message


def test_a_key_with_nothing_close_gets_no_guess() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({"zzzzzz": 1})
    assert refused.value.message == "config: unknown key 'zzzzzz'"
    assert did_you_mean(RunConfig, ("policy", "sampling", 0)) == ""


def _named_settings(text: str) -> set[str]:
    """Every dotted key the text names in backticks under a config section, and the first
    cell of every ``| key | …`` table."""
    named = set(re.findall(rf"`((?:{'|'.join(SECTIONS)})\.[a-z_][a-z_.]*)`", text))
    in_tables = False
    for line in text.splitlines():
        if line.startswith("| key |"):
            in_tables = True
            continue
        if in_tables and line.startswith("|"):
            cell = line.split("|")[1].strip()
            named.update(re.findall(r"`([a-z_][a-z_.]*)`", cell))
        elif in_tables and not line.startswith("|"):
            in_tables = False
    named = {n.rstrip(".") for n in named}
    return {n for n in named if n not in NOT_SETTINGS and not n.endswith(FILE_SUFFIXES)}


NOT_SETTINGS = {"ray.init", "ray.kill"}
"""Ray's own calls, named in the guide's Ray section."""
FILE_SUFFIXES = (".jsonl", ".json", ".log", ".yaml", ".html")
"""Files in the workdir (``metrics.jsonl``), not keys."""


@pytest.mark.parametrize("doc", ["guide.md", "trainers.md"])
def test_every_setting_the_docs_name_is_a_config_key(doc: str) -> None:
    text = (DOCS / doc).read_text()
    named = _named_settings(text)
    assert named, "the check found no setting to check"
    assert sorted(named - KEYS) == []
    assert "call_timeout_s" not in text  # a model server's field, not a config key
