"""The Grafana dashboard queries only metrics that rollpoint's processes really export.

The exported names are read from the live ``/metrics`` pages of real servers (the embedded
runtime's model, agent and resources servers) and of a trainer built over them, not from a
list kept by hand: a metric renamed or dropped in the code fails this test.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollpoint.app.config import parse_config
from tests.support.embedded_job import embedded_job

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "rollpoint.json"

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
}
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_VARIABLES = re.compile(r"\$\{?\w+\}?")
_NAME = re.compile(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")
_KEYWORDS = {"and", "or", "unless", "offset", "bool"}


def metric_names(promql: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, labels and keywords left out)."""
    text = _STRINGS.sub("", promql)
    text = _MATCHERS.sub("", text)
    text = _RANGES.sub("", text)
    text = _GROUPING.sub("", text)
    text = _VARIABLES.sub("", text)
    return {
        m.group(1)
        for m in _NAME.finditer(text)
        if m.group(2) is None and m.group(1) not in _KEYWORDS
    }


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of every panel (rows' panels too) and of the variables."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            expr = node.get("expr")
            if isinstance(expr, str):
                found.append(expr)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard.get("panels", []))
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        text = query.get("query") if isinstance(query, dict) else query
        if variable.get("type") == "query" and isinstance(text, str):
            # label_values(metric, label): the metric is the query.
            inner = re.fullmatch(r"\s*label_values\((.*),\s*\w+\)\s*", text)
            found.append(inner.group(1) if inner else text)
    return found


def exported(text: str) -> set[str]:
    """Every series name a page exports, as PromQL names them (with type suffixes)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + s for s in _SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return str(reply.read().decode())


def test_metric_names_of_promql_leave_out_functions_labels_and_variables() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, replica) (rate(rollpoint_model_call_seconds_bucket"
        '{replica=~"$replica"}[$__rate_interval]))) / ignoring(kind) up offset 5m'
    )
    assert metric_names(expr) == {"rollpoint_model_call_seconds_bucket", "up"}


@pytest.mark.process
async def test_every_dashboard_query_names_a_metric_the_servers_export(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = queries(dashboard)
    assert len(exprs) >= 20, "the dashboard lost its panels"
    config = parse_config(
        {"workdir": str(tmp_path / "run"), "tasks": 2, "group_size": 2, "replicas": 1}
    )
    config.workdir.mkdir(parents=True)
    async with embedded_job(config) as j:
        urls = [f"http://127.0.0.1:{j.metrics.serve()}/metrics"]
        for replica in j.deployment.replicas:
            urls += [
                f"{u}/metrics"
                for u in (replica.model_url, replica.agent_url, replica.resources_url)
            ]
        pages = await asyncio.gather(*(asyncio.to_thread(_get, u) for u in urls))
    live = set().union(*(exported(page) for page in pages))
    unknown = {}
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"a query that reads no metric: {expr}"
        if names - live:
            unknown[expr] = sorted(names - live)
    assert unknown == {}, "queries naming metrics nobody exports"
    # Each area the dashboard promises is there.
    read = set().union(*(metric_names(e) for e in exprs))
    for needed in (
        "rollpoint_snapshot_pause_seconds_bucket",
        "rollpoint_snapshot_prepare_seconds_sum",
        "rollpoint_snapshots_total",
        "rollpoint_episodes_in_flight",
        "rollpoint_episodes_parked",
        "rollpoint_rows_failed_total",
        "rollpoint_model_call_seconds_bucket",
        "rollpoint_model_calls_in_flight",
    ):
        assert needed in read, needed
