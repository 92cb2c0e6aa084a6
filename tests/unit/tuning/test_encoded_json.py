"""Pre-encoded parts of records: written as the value they encode, or left as the value."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollpoint.tuning.encoded_json import encoded, encoded_or_itself

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(JSON)
def test_an_encoded_value_is_written_as_the_value_itself(value: Any) -> None:
    record = {"kind": "session", "part": encoded(value), "parts": [encoded(value)]}
    assert orjson.loads(orjson.dumps(record)) == {
        "kind": "session",
        "part": value,
        "parts": [value],
    }


def test_a_value_orjson_cannot_encode_is_handed_back_for_the_write_to_name() -> None:
    odd = {"content": {1j}}
    assert encoded_or_itself(odd) is odd
    with pytest.raises(TypeError):
        orjson.dumps({"part": encoded_or_itself(odd)})


def test_an_encodable_value_is_encoded() -> None:
    part = encoded_or_itself({"role": "tool", "content": "ok ✓"})
    assert isinstance(part, orjson.Fragment)
    assert orjson.loads(orjson.dumps([part])) == [{"role": "tool", "content": "ok ✓"}]
