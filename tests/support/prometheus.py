"""Reading a live ``/metrics`` page: the samples a real server or trainer exports now."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


class Scrape:
    """One scrape of one ``/metrics`` URL."""

    def __init__(self, url: str) -> None:
        with urllib.request.urlopen(url, timeout=10) as reply:
            self.text = reply.read().decode()
        self.samples: dict[tuple[str, Labels], float] = {}
        self.families: set[str] = set()
        for family in text_string_to_metric_families(self.text):
            self.families.add(family.name)
            for s in family.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    @property
    def sample_names(self) -> set[str]:
        """Every series name as PromQL sees it (``_total``, ``_bucket``, ``_sum``... included)."""
        return {name for name, _ in self.samples}

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``; 0 when there are none."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= set(ls))

    def has(self, name: str) -> bool:
        return name in self.sample_names
