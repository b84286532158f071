"""JSON on the relay's path — the chunks a node reads from its upstream, seals and the coordinator
opens, the SSE events the coordinator and direct mode write — through orjson (several times faster
than the standard library), with the standard library taking whatever orjson refuses, so no input
fails for the speed:

- reading, orjson refuses NaN and Infinity, a BOM, lone surrogate escapes and numbers past a double,
  which ``json.loads`` takes (it also reads an integer past 64 bits as a float: no chunk field is one);
- writing, orjson refuses integers past 64 bits, keys that are not strings and strings holding lone
  surrogates, which ``json.dumps`` writes; it writes NaN and infinities as ``null`` where the
  standard library writes the non-JSON ``NaN`` and ``Infinity`` (which most clients cannot read).

Both write compact JSON, orjson with non-ASCII characters as themselves (UTF-8), the standard
library with ``\\u`` escapes. Consumer bodies are not read here: their parser
(``wire/openai/body.py``) must refuse NaN and keep big integers exact.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(data: bytes | str) -> Any:
    """``data`` parsed (``ValueError`` when it is not JSON)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def dumps(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return _stdlib_dumps(value).encode()


def dumps_text(value: Any) -> str:
    """``value`` as compact JSON text."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return _stdlib_dumps(value)


def _stdlib_dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))  # ASCII: a lone surrogate goes as its escape
