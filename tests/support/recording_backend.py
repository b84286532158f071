"""The llama.cpp backend that keeps what each generation did, for tests to read after a stream ends."""

from __future__ import annotations

from typing import Any

from darkbloom.provider.backends.llama_cpp import LlamaCppBackend
from darkbloom.provider.backends.base import Generation


class RecordingLlamaCppBackend(LlamaCppBackend):
    """`recent`: every generation the engine has let go of, newest last. A generation is recorded on the
    event loop just before its stream's terminal item is queued, so it is there by the time the
    stream's last chunk (or its meter's `stopped()`) reaches the caller."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recent: list[Generation] = []

    def _ended(self, generation: Generation) -> None:
        self.recent.append(generation)
