"""Repetition bounds of a JSON schema, checked before anything turns it into a grammar.

llama.cpp expands a bound such as `maxLength: n` (or a regex `{m,n}`) into n nested grammar rules.
Its grammar parser refuses more than 1,000 of them (measured on the bundled llama.cpp: 1,000 is the
largest `maxLength`, `maxItems` or `{0,n}` it accepts), and from about 20,000 the conversion
overflows the C stack and kills the process. So MAX_REPETITION is that 1,000: every schema under it
converts. The sum of all bounds is capped too (MAX_TOTAL_REPETITION: 1,000 properties of
`maxLength` 1,000 each take seconds to parse), and so is the number of optional properties of one
object (the converter's work is quadratic in them). The walk itself is bounded: a schema deeper
than MAX_DEPTH or with more than MAX_NODES sub-schemas is a problem too.
"""

from __future__ import annotations

import itertools
import re
from typing import Any, Iterator

MAX_REPETITION = 1000
MAX_TOTAL_REPETITION = 20_000
MAX_OPTIONAL_PROPERTIES = 128
MAX_DEPTH = 64
MAX_NODES = 10_000

_BOUND_KEYS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else",
                "additionalItems", "unevaluatedProperties", "unevaluatedItems")
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")

Problem = tuple[str, str]
_Node = tuple[Any, str, int]


def repetition_problem(schema: Any, param: str) -> Problem | None:
    """(the offending parameter path under `param`, a sentence) for the first bound of `schema` over
    MAX_REPETITION (or the other limits above); None when the schema is fine."""
    total, seen = 0, 0
    stack: list[_Node] = [(schema, param, 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, list) and path.endswith(".items"):  # the old tuple form of `items`
            stack.extend(itertools.islice(((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node)),
                                          MAX_NODES + 1))
            continue
        if not isinstance(node, dict):
            continue
        seen += 1
        if seen > MAX_NODES:
            return param, f"the JSON schema in {param} has more than {MAX_NODES} sub-schemas"
        if depth > MAX_DEPTH:
            return param, f"the JSON schema in {param} is nested deeper than {MAX_DEPTH} levels"
        bounds: list[tuple[str, Any]] = [(f"{path}.{key}", node.get(key)) for key in _BOUND_KEYS]
        if isinstance(node.get("pattern"), str):
            bounds += [(f"{path}.pattern", n) for match in _QUANTIFIER.finditer(node["pattern"])
                       for n in match.groups() if n]
        for where, value in bounds:
            count = _count(value)
            if count > MAX_REPETITION:
                return where, (f"{where} repeats a part more than {MAX_REPETITION} times" if where.endswith(".pattern")
                               else f"{where} must be at most {MAX_REPETITION}")
            total += count
            if total > MAX_TOTAL_REPETITION:
                return where, (f"the repetition bounds in {param} add up to more than {MAX_TOTAL_REPETITION} "
                               f"(at {where})")
        optional = _optional_properties(node)
        if optional > MAX_OPTIONAL_PROPERTIES:
            return f"{path}.properties", (f"{path}.properties may have at most {MAX_OPTIONAL_PROPERTIES} "
                                          "properties that are not required")
        stack.extend(reversed(list(itertools.islice(_children(node, path, depth), MAX_NODES + 1))))
    return None


def _count(value: Any) -> int:
    """A bound as a repetition count: an integer, a number, or the digits of a regex quantifier."""
    if isinstance(value, str):
        return MAX_REPETITION + 1 if len(value) > 6 else int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    if not value <= MAX_REPETITION:  # also NaN
        return MAX_REPETITION + 1
    return max(0, int(value))


def _optional_properties(node: dict[str, Any]) -> int:
    properties, required = node.get("properties"), node.get("required")
    if not isinstance(properties, dict):
        return 0
    needed = {name for name in required if isinstance(name, str)} if isinstance(required, list) else set()
    return sum(1 for name in properties if name not in needed)


def _children(node: dict[str, Any], path: str, depth: int) -> Iterator[_Node]:
    for key in _SCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            yield from ((sub, f"{path}.{key}.{name}", depth + 1) for name, sub in value.items())
    for key in _SCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            yield from ((sub, f"{path}.{key}[{i}]", depth + 1) for i, sub in enumerate(value))
    for key in _SCHEMA_ONES:
        if key in node:
            yield node[key], f"{path}.{key}", depth + 1
