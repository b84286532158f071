"""A fixed-response OpenAI-compatible server, so benchmarks measure the relay and not a model.

Named as what it is: a benchmark fake. Run: python bench/fixed_upstream.py PORT
"""

from __future__ import annotations

import json
import sys
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."]
USAGE = {"prompt_tokens": 12, "completion_tokens": len(WORDS), "total_tokens": 12 + len(WORDS)}


def _chunk(model: str, delta: dict[str, str], finish: str | None = None) -> bytes:
    data = {"id": "chatcmpl-fixed", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def chat(request: Request) -> Response:
    body = await request.json()
    model = body.get("model", "fixed")
    if not body.get("stream"):
        return JSONResponse({"id": "chatcmpl-fixed", "object": "chat.completion", "created": int(time.time()),
                             "model": model, "usage": USAGE,
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "".join(WORDS)}}]})

    async def events():  # type: ignore[no-untyped-def]
        yield _chunk(model, {"role": "assistant", "content": ""})
        for word in WORDS:
            yield _chunk(model, {"content": word})
        yield _chunk(model, {}, "stop")
        usage = {"id": "chatcmpl-fixed", "object": "chat.completion.chunk", "created": int(time.time()),
                 "model": model, "choices": [], "usage": USAGE}
        yield b"data: " + json.dumps(usage).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
