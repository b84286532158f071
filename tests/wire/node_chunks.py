"""Node chunks as a node streams them (the interface file's shapes), for the presenter tests, and
an SSE reader that keeps `event:` names."""

from __future__ import annotations

import json
from typing import Any

from darkbloom.wire.protocol import Usage

USAGE = Usage(prompt_tokens=7, completion_tokens=5)


def chat(delta: dict[str, Any] | None = None, finish: str | None = None,
         logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return {"id": "node-id", "object": "chat.completion.chunk", "created": 1, "model": "node-model",
            "choices": [choice]}


def text_chunks(*parts: str, finish: str = "stop") -> list[dict[str, Any]]:
    return ([chat({"role": "assistant", "content": ""})] + [chat({"content": part}) for part in parts]
            + [chat({}, finish)])


def tool_chunks(name: str = "get_weather", arguments: tuple[str, ...] = ('{"city": ', '"Paris"}'),
                call_id: str = "call_abc123", index: int = 0, finish: str | None = "tool_calls",
                role: bool = True) -> list[dict[str, Any]]:
    chunks = [chat({"role": "assistant"})] if role else []
    chunks.append(chat({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                        "function": {"name": name, "arguments": ""}}]}))
    chunks += [chat({"tool_calls": [{"index": index, "function": {"arguments": part}}]}) for part in arguments]
    if finish:
        chunks.append(chat({}, finish))
    return chunks


def completion(text: str, finish: str | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": "node-id", "object": "text_completion", "created": 1, "model": "node-model",
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def sse_events(raw: bytes | list[bytes]) -> list[tuple[str | None, Any]]:
    """(event name or None, parsed data or "[DONE]") for each SSE event."""
    text = (b"".join(raw) if isinstance(raw, list) else raw).decode()
    out: list[tuple[str | None, Any]] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
        joined = "\n".join(data)
        out.append((name, joined if joined == "[DONE]" else json.loads(joined)))
    return out


def run_stream(presenter: Any, chunks: list[dict[str, Any]], usage: Usage = USAGE,
               cost_micro_usd: int | None = None) -> list[bytes]:
    parts = list(presenter.stream_start())
    for chunk in chunks:
        parts += presenter.stream_chunk(chunk)
    return parts + presenter.stream_end(usage, cost_micro_usd)


def run_collect(presenter: Any, chunks: list[dict[str, Any]], usage: Usage = USAGE,
                cost_micro_usd: int | None = None) -> dict[str, Any]:
    for chunk in chunks:
        presenter.collect(chunk)
    return presenter.response(usage, cost_micro_usd)
