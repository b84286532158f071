"""The one interface every inference backend implements."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Protocol


class BackendError(Exception):
    """A request the backend rejected (4xx) or could not serve (5xx)."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message


class Backend(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def stream_chat(self, model_id: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """OpenAI `chat.completion.chunk` dicts, ending with one chunk whose `choices` is empty and
        whose `usage` holds the real token counts. Closing the iterator early stops generation."""
        ...


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage_chunk(completion_id: str, model_id: str, created: int | None,
                prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()) if created is None else created,
        "model": model_id,
        "choices": [],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def is_usage_chunk(chunk: dict[str, Any]) -> bool:
    return not chunk.get("choices") and isinstance(chunk.get("usage"), dict)
