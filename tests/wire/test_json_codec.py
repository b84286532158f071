"""JSON on the relay's path: what orjson refuses, the standard library takes, so an upstream's odd
but valid-for-Python chunk is relayed, never a failed request; what is written is always JSON."""

from __future__ import annotations

import json
import math

import pytest
from starlette.responses import JSONResponse

from darkbloom.wire import json_codec
from darkbloom.wire.openai.answers import JsonAnswer


@pytest.mark.parametrize("raw, expected", [
    (b'{"a": 1}', {"a": 1}),
    (b'\xef\xbb\xbf{"a": 1}', {"a": 1}),  # a BOM
    (b'"\\ud800"', "\ud800"),  # a lone surrogate escape
    (b'{"big": 1e400}', {"big": math.inf}),  # past a double
])
def test_loads_takes_what_the_standard_library_takes(raw: bytes, expected: object) -> None:
    assert json_codec.loads(raw) == expected


def test_loads_takes_nan_and_refuses_what_is_not_json() -> None:
    assert math.isnan(json_codec.loads(b'{"x": NaN}')["x"])
    with pytest.raises(ValueError):
        json_codec.loads(b'{"x": ')


@pytest.mark.parametrize("value", [
    {"n": 2 ** 70},  # past 64 bits
    {1: "a non-string key"},
    {"text": "a lone \ud800 surrogate"},
    {"text": "héllo ✓", "n": [1, 2.5, None, True]},
])
def test_dumps_writes_json_the_standard_library_reads_back(value: object) -> None:
    text = json_codec.dumps_text(value)
    assert json_codec.dumps(value) == text.encode()  # valid UTF-8: it seals and sends as it is
    assert json.loads(text) == json.loads(json.dumps(value))


def test_both_ways_write_compact_json() -> None:
    assert json_codec.dumps_text({"a": [1, "é"]}) == '{"a":[1,"é"]}'
    assert json_codec.dumps_text({1: [1, "\ud800"]}) == '{"1":[1,"\\ud800"]}'  # the standard library's way


def test_what_is_not_a_json_number_is_written_as_null() -> None:
    """A -inf logprob went out as ``-Infinity``, which JSON parsers refuse."""
    assert json_codec.dumps_text({"logprob": -math.inf, "x": math.nan}) == '{"logprob":null,"x":null}'


def test_a_json_answer_is_written_by_the_codec() -> None:
    """The edge's JSON answer (coordinator and direct mode): what Starlette's ``JSONResponse`` would
    refuse with a 500 (a -inf logprob) goes out as ``null``; a big integer stays exact."""
    answer = JsonAnswer({"logprob": -math.inf, "text": "é"}, headers={"X-Request-Id": "r"})
    assert answer.body == '{"logprob":null,"text":"é"}'.encode()
    assert json.loads(JsonAnswer({"n": 2 ** 70}).body) == {"n": 2 ** 70}
    assert answer.headers["content-type"] == "application/json"
    assert answer.headers["x-request-id"] == "r"
    with pytest.raises(ValueError):
        JSONResponse({"logprob": -math.inf})
