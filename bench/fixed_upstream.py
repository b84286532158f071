"""A fixed-response OpenAI-compatible server, so benchmarks measure the relay and not a model.

Named as what it is: a benchmark fake. Run: python bench/fixed_upstream.py PORT
[--delay SECONDS] [--first-delay SECONDS]: tests that need requests to stay in flight (billing
under concurrency, a coordinator crash with reservations open) slow it down; by default it answers
at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."]
USAGE = {"prompt_tokens": 12, "completion_tokens": len(WORDS), "total_tokens": 12 + len(WORDS)}
DELAY = 0.0        # seconds before each content chunk
FIRST_DELAY = 0.0  # seconds before the first byte of the answer


def _chunk(model: str, delta: dict[str, str], finish: str | None = None) -> bytes:
    data = {"id": "chatcmpl-fixed", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def chat(request: Request) -> Response:
    body = await request.json()
    model = body.get("model", "fixed")
    if FIRST_DELAY:
        await asyncio.sleep(FIRST_DELAY)
    if not body.get("stream"):
        if DELAY:
            await asyncio.sleep(DELAY * len(WORDS))
        return JSONResponse({"id": "chatcmpl-fixed", "object": "chat.completion", "created": int(time.time()),
                             "model": model, "usage": USAGE,
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "".join(WORDS)}}]})

    async def events():  # type: ignore[no-untyped-def]
        yield _chunk(model, {"role": "assistant", "content": ""})
        for word in WORDS:
            if DELAY:
                await asyncio.sleep(DELAY)
            yield _chunk(model, {"content": word})
        yield _chunk(model, {}, "stop")
        usage = {"id": "chatcmpl-fixed", "object": "chat.completion.chunk", "created": int(time.time()),
                 "model": model, "choices": [], "usage": USAGE}
        yield b"data: " + json.dumps(usage).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("port", type=int)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before each content chunk")
    parser.add_argument("--first-delay", type=float, default=0.0, help="seconds before the answer starts")
    args = parser.parse_args()
    DELAY, FIRST_DELAY = args.delay, args.first_delay
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
