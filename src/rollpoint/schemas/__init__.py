"""JSON Schemas of rollpoint's files for other programs to read them by.

Owns the schema files shipped with the package and :func:`train_data_schema`, which reads
``train_data.schema.json``: one line of ``train_data.jsonl`` (JSON Schema 2020-12). The
file is what rollpoint writes (:func:`rollpoint.trainer.record.workdir_record.train_rows`), and a
test validates real rows against it (with and without token capture, continued episodes and
calls cut by a snapshot). rollpoint itself never validates against it at run time.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import orjson

TRAIN_DATA_SCHEMA = "train_data.schema.json"


def train_data_schema() -> dict[str, Any]:
    """The schema of one ``train_data.jsonl`` line, as a dict."""
    raw = resources.files(__name__).joinpath(TRAIN_DATA_SCHEMA).read_bytes()
    schema: dict[str, Any] = orjson.loads(raw)
    return schema
