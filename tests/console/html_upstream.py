"""A fake OpenAI-compatible upstream for the console tests: every answer is the same Markdown with
HTML in it, so the browser test can check deterministically that model output is shown as text.

Named as what it is: a test fake (a node runs it as its `--backend openai` upstream). Run:
python tests/console/html_upstream.py PORT
"""

from __future__ import annotations

import json
import sys
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

ANSWER = ("Here is **bold** and `code`.\n\n"
          "<script>window.__pwned = 1; alert(1)</script>\n\n"
          "<img src=x onerror=\"window.__pwned = 2\"> [click](javascript:window.__pwned=3)")
# streamed in small pieces, splitting the tags, as a real model would
PIECES = [ANSWER[i:i + 7] for i in range(0, len(ANSWER), 7)]


def _event(data: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def chat(request: Request) -> Response:
    body = await request.json()
    model = body.get("model", "html-echo")

    def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
        return _event({"id": "chatcmpl-html", "object": "chat.completion.chunk", "created": int(time.time()),
                       "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    async def events():  # type: ignore[no-untyped-def]
        yield chunk({"role": "assistant", "content": ""})
        for piece in PIECES:
            yield chunk({"content": piece})
        yield chunk({}, "stop")
        yield _event({"id": "chatcmpl-html", "object": "chat.completion.chunk", "created": int(time.time()),
                      "model": model, "choices": [],
                      "usage": {"prompt_tokens": 9, "completion_tokens": len(PIECES),
                                "total_tokens": 9 + len(PIECES)}})
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
