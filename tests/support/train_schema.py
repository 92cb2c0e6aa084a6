"""Real ``train_data.jsonl`` rows against the schema rollpoint ships for them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jsonschema import Draft202012Validator

from rollpoint.schemas import train_data_schema

_VALIDATOR = Draft202012Validator(train_data_schema())


def check_train_rows(rows: Iterable[Any]) -> int:
    """Every row valid (the first error names the row and the field); how many there were."""
    count = 0
    for count, row in enumerate(rows, 1):
        error = next(iter(_VALIDATOR.iter_errors(row)), None)
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "the row"
            raise AssertionError(f"train_data row {count}: {where}: {error.message}")
    return count
