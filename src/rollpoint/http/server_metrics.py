"""Prometheus ``GET /metrics`` on every rollpoint server, from a registry of its own.

Owns :class:`ServerMetrics`: one :class:`~prometheus_client.CollectorRegistry` per app (in a
run each server is a process of its own, but tests start several servers in one process,
where prometheus-client's global registry would collide and mix their counts), the
``/metrics`` route, and the labels every series carries (``server`` and ``replica``, so one
dashboard tells replicas apart without relabelling).

It does not decide what a server counts. A server keeps plain ints on its hot path and hands
:meth:`ServerMetrics.read` a function that turns them into :class:`Reading` values at scrape
time (nothing is locked or formatted per call); only latency histograms are observed per
call (:meth:`ServerMetrics.histogram`). ``/metrics`` is open like ``/healthz`` (see
:mod:`rollpoint.http.auth`): it shows counts, never episodes, messages or tokens.
Every name starts with ``rollpoint_``; docs/guide.md lists them.

prometheus-client comes with the ``metrics`` extra: importing this module needs none (a
server that is never built never asks for it); a :class:`ServerMetrics` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from fastapi import FastAPI
from fastapi.responses import Response

from rollpoint.common.extras import need

if TYPE_CHECKING:
    from prometheus_client import Histogram
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

METRICS_PATH = "/metrics"

# Policy calls through a model server: a scripted call takes milliseconds, a real engine's
# generation up to minutes.
CALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass(frozen=True, slots=True)
class Reading:
    """One sample of a series, read from a server's own tallies at scrape time."""

    name: str
    """Without the ``_total`` suffix of a counter (prometheus-client adds it)."""
    doc: str
    value: float
    kind: Literal["counter", "gauge"] = "gauge"
    labels: Mapping[str, str] = field(default_factory=dict)
    """Labels beyond ``server`` and ``replica``; every reading of one name has the same keys."""


class _Readings:
    """A prometheus-client ``Collector`` (a protocol: no import of it needed)."""

    def __init__(self, read: Callable[[], Iterable[Reading]], base: Mapping[str, str]) -> None:
        self._read = read
        self._base = base

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for r in self._read():
            family = families.get(r.name)
            if family is None:
                keys = [*self._base, *r.labels]
                cls = CounterMetricFamily if r.kind == "counter" else GaugeMetricFamily
                family = families[r.name] = cls(r.name, r.doc, labels=keys)
            family.add_metric([*self._base.values(), *r.labels.values()], r.value)
        yield from families.values()


class ServerMetrics:
    """The registry of one server app, with its ``server`` and ``replica`` labels."""

    def __init__(self, *, server: str, replica: str) -> None:
        need("metrics", f"the {server} server's /metrics")
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()
        self._base = {"server": server, "replica": replica}

    def read(self, read: Callable[[], Iterable[Reading]]) -> None:
        """Call ``read`` at every scrape for the server's counters and gauges."""
        self.registry.register(_Readings(read, self._base))

    def histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        """A histogram with this server's labels bound: call ``observe`` on it."""
        from prometheus_client import Histogram

        family = Histogram(
            name, doc, list(self._base), registry=self.registry, buckets=tuple(buckets)
        )
        child: Histogram = family.labels(**self._base)
        return child

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def mount(self, app: FastAPI) -> None:
        """Serve the registry at ``GET /metrics`` on ``app``."""

        from prometheus_client import CONTENT_TYPE_LATEST

        async def metrics() -> Response:
            return Response(self.render(), media_type=CONTENT_TYPE_LATEST)

        app.add_api_route(METRICS_PATH, metrics, methods=["GET"], include_in_schema=False)
