"""A batch input file is checked line by line; the first bad line is named by its number."""

from __future__ import annotations

import json

import pytest

from darkbloom.coordinator.batches.input_file import check_input_file
from darkbloom.wire.openai.errors import ApiError

CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def line(custom_id: str = "a", url: str = "/v1/chat/completions", body: object = None, **extra: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": CHAT if body is None else body, **extra})


def check(*lines: str, max_lines: int = 100, max_body_bytes: int = 8 * 1024 * 1024) -> list:
    return check_input_file(("\n".join(lines) + "\n").encode(), max_lines=max_lines, max_body_bytes=max_body_bytes)


def refused(*lines: str, **limits: int) -> ApiError:
    with pytest.raises(ApiError) as caught:
        check(*lines, **limits)
    assert caught.value.status == 400 and caught.value.type == "invalid_request_error"
    return caught.value


def test_a_good_file_gives_every_line_in_order() -> None:
    found = check(line("a"), line("b", "/v1/embeddings", {"model": "m", "input": "x"}),
                  line("c", "/v1/completions", {"model": "m", "prompt": "x"}),
                  line("d", "/v1/responses", {"model": "m", "input": "x"}))
    assert [(f.line_no, f.custom_id, f.url) for f in found] == [
        (1, "a", "/v1/chat/completions"), (2, "b", "/v1/embeddings"), (3, "c", "/v1/completions"),
        (4, "d", "/v1/responses")]
    assert json.loads(found[0].body) == CHAT


def test_crlf_line_ends_and_no_final_newline_are_accepted() -> None:
    content = (line("a") + "\r\n" + line("b")).encode()
    assert [f.custom_id for f in check_input_file(content, max_lines=10, max_body_bytes=10_000)] == ["a", "b"]


@pytest.mark.parametrize("bad, why", [
    ("not json at all", "not a JSON object"),
    ("[1, 2]", "not a JSON object"),
    ("", "empty"),
    (line(url="/v1/messages"), "'url' must be one of"),
    (line(url="/v1/chat/completions/"), "'url' must be one of"),
    (line(method="GET"), "'method'"),
    (line(custom_id=""), "'custom_id'"),
    (line(custom_id="x" * 513), "'custom_id'"),
    (line(body="text"), "'body' must be a JSON object"),
    (line(body={**CHAT, "stream": True}), "cannot stream"),
    (line(body={"messages": CHAT["messages"]}), "'model'"),
    (line(body={**CHAT, "temperature": "hot"}), "'temperature'"),
    (line(body={**CHAT, "messages": []}), "messages"),
])
def test_the_first_bad_line_is_named(bad: str, why: str) -> None:
    error = refused(line("ok"), bad)
    assert "Line 2 " in error.message and why in error.message, error.message
    assert error.param == "file"


def test_a_custom_id_used_twice_is_refused_at_its_second_line() -> None:
    error = refused(line("a"), line("b"), line("a"))
    assert "Line 3 " in error.message and "custom_id 'a'" in error.message


def test_a_body_over_the_live_limit_is_refused() -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
    error = refused(line("a", body=big), max_body_bytes=1000)
    assert "Line 1 " in error.message and "1000-byte limit" in error.message


def test_too_many_lines_and_empty_files_are_refused() -> None:
    assert "at most 2" in refused(line("a"), line("b"), line("c"), max_lines=2).message
    with pytest.raises(ApiError, match="empty"):
        check_input_file(b"", max_lines=10, max_body_bytes=100)


def test_a_file_that_is_not_utf8_is_refused() -> None:
    with pytest.raises(ApiError, match="not UTF-8"):
        check_input_file(b"\xff\xfe" + line().encode(), max_lines=10, max_body_bytes=10_000)
