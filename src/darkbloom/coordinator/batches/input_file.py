"""A batch input file checked line by line, as it is uploaded and again when a batch is made from it:
JSONL, each line ``{custom_id, method: "POST", url, body}`` with a unique ``custom_id``, a batchable
``url`` and a body a live request of that endpoint could send (checked by the same schema; not
streamed). The first bad line is named in a 400."""

from __future__ import annotations

import json
from dataclasses import dataclass

from darkbloom.coordinator.inference.calls import parse_call
from darkbloom.wire.openai.body import parse_json_object
from darkbloom.wire.openai.edges import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, Edge
from darkbloom.wire.openai.errors import ApiError, invalid_request

BATCH_EDGES: dict[str, Edge] = {edge.path: edge for edge in (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES)}
MAX_CUSTOM_ID = 512


@dataclass(frozen=True)
class InputLine:
    line_no: int     # 1-based, as an editor numbers the file's lines
    custom_id: str
    url: str
    body: str        # the request body, as JSON text


def check_input_file(content: bytes, *, max_lines: int, max_body_bytes: int) -> list[InputLine]:
    """Every request of the file, or the 400 naming its first bad line."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid_request(f"The file is not UTF-8 text (at byte {exc.start}); a batch input file is JSONL.",
                              param="file") from None
    rows = text.split("\n")
    if rows and rows[-1] == "":
        rows.pop()  # the newline that ends the last line
    if not rows:
        raise invalid_request("The file is empty; a batch input file holds one request per line.", param="file")
    if len(rows) > max_lines:
        raise invalid_request(f"The file has {len(rows)} lines; a batch input file may have at most {max_lines}.",
                              param="file")
    seen: set[str] = set()
    lines = []
    for index, row in enumerate(rows):
        line = _check_line(index + 1, row.removesuffix("\r"), max_body_bytes)
        if line.custom_id in seen:
            raise _bad(line.line_no, f"custom_id '{line.custom_id}' is used by an earlier line; each must be unique")
        seen.add(line.custom_id)
        lines.append(line)
    return lines


def _check_line(line_no: int, row: str, max_body_bytes: int) -> InputLine:
    if not row.strip():
        raise _bad(line_no, "it is empty; each line is one JSON request")
    try:
        request = parse_json_object(row.encode())
    except ApiError:
        raise _bad(line_no, "it is not a JSON object") from None
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise _bad(line_no, f"'custom_id' must be a string of 1 to {MAX_CUSTOM_ID} characters")
    if request.get("method") != "POST":
        raise _bad(line_no, "'method' must be \"POST\"")
    url = request.get("url")
    edge = BATCH_EDGES.get(url) if isinstance(url, str) else None
    if edge is None or not isinstance(url, str):
        raise _bad(line_no, f"'url' must be one of {', '.join(BATCH_EDGES)}")
    body = request.get("body")
    if not isinstance(body, dict):
        raise _bad(line_no, "'body' must be a JSON object (the request's body)")
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    if len(text.encode()) > max_body_bytes:
        raise _bad(line_no, f"its body is over the {max_body_bytes}-byte limit of a request")
    if body.get("stream"):
        raise _bad(line_no, "a batch request cannot stream ('stream' must be false or absent)")
    try:
        parse_call(text.encode(), edge)
    except ApiError as exc:
        where = f" ('{exc.param}')" if exc.param else ""
        raise _bad(line_no, f"its body is not a valid {url} request{where}: {exc.message}") from None
    return InputLine(line_no, custom_id, url, text)


def _bad(line_no: int, why: str) -> ApiError:
    return invalid_request(f"Line {line_no} of the file cannot be run: {why}.", param="file")
