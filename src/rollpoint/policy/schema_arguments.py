"""Seeded, schema-valid tool arguments: a value for a tool's JSON schema, drawn from an rng.

Owns turning the ``parameters`` schema of an OpenAI function tool (what pydantic's
``model_json_schema`` emits, and what hand-written tool specs use) into one value that the
schema accepts, the same value for the same rng state. It covers the keywords tool schemas
use: ``type`` (one or a list), ``enum``/``const``, ``anyOf``/``oneOf`` (one branch),
``allOf`` (merged), local ``$ref`` into ``$defs``/``definitions``, string lengths and
``format: date``/``time``/``date-time``, number bounds (inclusive and exclusive,
``multipleOf`` for integers), array lengths and ``uniqueItems``, object ``required`` and
``properties`` (every required one, and each optional one with an even chance).

A ``pattern`` is honoured by generating text from the parsed regular expression (literals,
classes and ranges, ``.``, ``\\d``/``\\w``/``\\s``, groups, alternation and repeats; anchors
and lookarounds are skipped) and keeping the first draw that matches it and the length
bounds; when none does, the last draw is sent (the environment answers with an error the
policy reads, as a model's wrong call would). Does not own which tool to call or when
(:mod:`rollpoint.policy.playbook`).
"""

from __future__ import annotations

import importlib
import random
import re
import string
from typing import Any

_ALPHABET = string.ascii_lowercase + string.digits
_PATTERN_TRIES = 24
_MAX_DEPTH = 8
"""Deeper than this (a recursive ``$ref``), an optional part is left out and a required one
is the simplest value of its type."""
_DEFAULT_MAX_LEN = 12
_DEFAULT_MAX_ITEMS = 3


def sample_arguments(schema: dict[str, Any] | None, rng: random.Random) -> dict[str, Any]:
    """Arguments for a tool whose ``parameters`` schema is ``schema`` (None: no arguments)."""
    if not schema:
        return {}
    value = _Sampler(schema, rng).value(schema, 0)
    return value if isinstance(value, dict) else {}


class _Sampler:
    def __init__(self, root: dict[str, Any], rng: random.Random) -> None:
        self.root = root
        self.rng = rng

    def _resolve(self, node: dict[str, Any]) -> dict[str, Any]:
        ref = node.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return node
        target: Any = self.root
        for part in ref[2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        rest = {k: v for k, v in node.items() if k != "$ref"}
        return {**(target if isinstance(target, dict) else {}), **rest}

    def value(self, node: Any, depth: int) -> Any:
        if not isinstance(node, dict):
            return None  # ``true`` / ``{}``-like leaves: anything goes; null is simplest
        node = self._resolve(node)
        if "const" in node:
            return node["const"]
        if isinstance(node.get("enum"), list) and node["enum"]:
            return self.rng.choice(node["enum"])
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches:
                # Prefer a non-null branch: ``X | None`` should mostly give an X.
                concrete = [b for b in branches if not _is_null(self._resolve(b))] or branches
                return self.value(self.rng.choice(concrete), depth + 1)
        if isinstance(node.get("allOf"), list):
            merged: dict[str, Any] = {k: v for k, v in node.items() if k != "allOf"}
            for part in node["allOf"]:
                merged.update(self._resolve(part) if isinstance(part, dict) else {})
            return self.value(merged, depth + 1)
        kind = node.get("type")
        if isinstance(kind, list):
            kinds = [k for k in kind if k != "null"] or kind
            kind = self.rng.choice(kinds)
        if kind is None:
            kind = "object" if "properties" in node else "string"
        return self._typed(str(kind), node, depth)

    def _typed(self, kind: str, node: dict[str, Any], depth: int) -> Any:
        if kind == "object":
            return self._object(node, depth)
        if kind == "array":
            return self._array(node, depth)
        if kind == "integer":
            return self._integer(node)
        if kind == "number":
            return self._number(node)
        if kind == "boolean":
            return self.rng.random() < 0.5
        if kind == "null":
            return None
        return self._string(node)

    def _object(self, node: dict[str, Any], depth: int) -> dict[str, Any]:
        props = node.get("properties")
        props = props if isinstance(props, dict) else {}
        required = node.get("required")
        required = set(required) if isinstance(required, list) else set()
        out: dict[str, Any] = {}
        for name, sub in props.items():
            keep = name in required or (depth < _MAX_DEPTH and self.rng.random() < 0.5)
            if keep:
                out[name] = self.value(sub, depth + 1) if depth < _MAX_DEPTH else None
        return out

    def _array(self, node: dict[str, Any], depth: int) -> list[Any]:
        low = _int(node.get("minItems"), 0)
        high = max(low, _int(node.get("maxItems"), low + _DEFAULT_MAX_ITEMS))
        count = self.rng.randint(low, high) if depth < _MAX_DEPTH else low
        items = node.get("items", {})
        out: list[Any] = []
        for _ in range(count * 4 if node.get("uniqueItems") else count):
            item = self.value(items, depth + 1)
            if node.get("uniqueItems") and item in out:
                continue
            out.append(item)
            if len(out) == count:
                break
        return out

    def _integer(self, node: dict[str, Any]) -> int:
        low = _bound(node, "minimum", "exclusiveMinimum", up=True, default=-100)
        high = _bound(node, "maximum", "exclusiveMaximum", up=False, default=low + 200)
        high = max(low, high)
        step = _int(node.get("multipleOf"), 1) or 1
        first = -(-low // step) * step
        if first > high:
            return low
        return first + step * self.rng.randint(0, (high - first) // step)

    def _number(self, node: dict[str, Any]) -> float:
        def bound(inclusive: str, exclusive: str, default: float) -> tuple[float, bool]:
            for key, is_open in ((inclusive, False), (exclusive, True)):
                value = node.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    return float(value), is_open
            return default, False

        low, low_open = bound("minimum", "exclusiveMinimum", -100.0)
        high, high_open = bound("maximum", "exclusiveMaximum", low + 200.0)
        high = max(low, high)
        value = round(self.rng.uniform(low, high), 3)
        if (low_open and value <= low) or (high_open and value >= high):
            value = (low + high) / 2
        return value

    def _string(self, node: dict[str, Any]) -> str:
        fmt = node.get("format")
        if fmt == "date":
            return f"2026-{self.rng.randint(1, 12):02d}-{self.rng.randint(1, 28):02d}"
        if fmt == "time":
            return f"{self.rng.randint(0, 23):02d}:{self.rng.choice((0, 15, 30, 45)):02d}:00"
        if fmt == "date-time":
            return f"2026-{self.rng.randint(1, 12):02d}-{self.rng.randint(1, 28):02d}T09:00:00Z"
        low = _int(node.get("minLength"), 1)
        high = max(low, _int(node.get("maxLength"), max(low, _DEFAULT_MAX_LEN)))
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            candidate = ""
            for _ in range(_PATTERN_TRIES):
                candidate = _from_pattern(pattern, self.rng)
                if low <= len(candidate) <= high and _matches(pattern, candidate):
                    break
            return candidate
        size = self.rng.randint(low, min(high, low + _DEFAULT_MAX_LEN))
        return "".join(self.rng.choice(_ALPHABET) for _ in range(size))


def _is_null(node: dict[str, Any]) -> bool:
    return node.get("type") == "null"


def _int(value: Any, default: int) -> int:
    return (
        int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default
    )


def _bound(node: dict[str, Any], inclusive: str, exclusive: str, *, up: bool, default: int) -> int:
    if isinstance(node.get(inclusive), (int, float)):
        value = node[inclusive]
        return int(-(-value // 1)) if up else int(value // 1)
    if isinstance(node.get(exclusive), (int, float)):
        value = node[exclusive]
        return int(value // 1) + 1 if up else int(-(-value // 1)) - 1
    return default


_CATEGORY_CHARS = {
    "CATEGORY_DIGIT": string.digits,
    "CATEGORY_WORD": _ALPHABET + "_",
    "CATEGORY_SPACE": " ",
}
_OPEN_REPEAT = 3
"""``*``, ``+`` and ``{n,}`` repeat at most this many times past their minimum."""


def _from_pattern(pattern: str, rng: random.Random) -> str:
    # The standard library's own regex parser (re._parser, private but stable since 3.11):
    # writing a second regex grammar here would only disagree with the one that checks.
    sre_parse: Any = importlib.import_module("re._parser")
    try:
        parsed = sre_parse.parse(pattern)
    except re.error:
        return ""
    out: list[str] = []
    _emit(list(parsed), rng, out)
    return "".join(out)


def _emit(items: list[Any], rng: random.Random, out: list[str]) -> None:
    for op, arg in items:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(arg))
        elif name == "ANY":
            out.append(rng.choice(_ALPHABET))
        elif name == "IN":
            out.append(_from_class(arg, rng))
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, sub = arg
            high = min(high, low + _OPEN_REPEAT)
            for _ in range(rng.randint(low, high)):
                _emit(list(sub), rng, out)
        elif name == "SUBPATTERN":
            _emit(list(arg[-1]), rng, out)
        elif name == "BRANCH":
            _emit(list(rng.choice(arg[1])), rng, out)
        elif name == "ATOMIC_GROUP":
            _emit(list(arg), rng, out)
        # AT (anchors), ASSERT/ASSERT_NOT (lookarounds), GROUPREF: nothing to write


def _from_class(items: list[Any], rng: random.Random) -> str:
    if items and str(items[0][0]) == "NEGATE":
        banned = {c for c in _ALPHABET if re.fullmatch(_class_regex(items), c) is None}
        allowed = [c for c in _ALPHABET if c not in banned] or ["~"]
        return rng.choice(allowed)
    choices: list[str] = []
    for op, arg in items:
        name = str(op)
        if name == "LITERAL":
            choices.append(chr(arg))
        elif name == "RANGE":
            choices.extend(chr(c) for c in range(arg[0], min(arg[1], arg[0] + 95) + 1))
        elif name == "CATEGORY":
            choices.extend(_CATEGORY_CHARS.get(str(arg), _ALPHABET))
    return rng.choice(choices or list(_ALPHABET))


def _class_regex(items: list[Any]) -> str:
    # A negated class: test our alphabet against it rather than invert it by hand.
    parts: list[str] = []
    for op, arg in items[1:]:
        name = str(op)
        if name == "LITERAL":
            parts.append(re.escape(chr(arg)))
        elif name == "RANGE":
            parts.append(f"{re.escape(chr(arg[0]))}-{re.escape(chr(arg[1]))}")
        elif name == "CATEGORY":
            parts.append({"CATEGORY_DIGIT": r"\d", "CATEGORY_WORD": r"\w"}.get(str(arg), r"\s"))
    return f"[^{''.join(parts)}]"


def _matches(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return True  # a pattern Python cannot read is not ours to enforce
