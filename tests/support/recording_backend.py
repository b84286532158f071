"""The llama.cpp backend that keeps what each generation did, for tests to read after a stream ends."""

from __future__ import annotations

from typing import Any, Callable

from darkbloom.provider.backends.llama_cpp import LlamaCppBackend, Work
from darkbloom.provider.backends.llama_instances import CountingLlama, GenerationStats


class RecordingLlamaCppBackend(LlamaCppBackend):
    """`recent`: every generation whose worker has stopped, newest last. A generation is recorded on
    its worker thread just before its instance goes back to the pool, so it is there by the time the
    stream's last chunk (or its meter's `stopped()`) reaches the caller."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recent: list[GenerationStats] = []

    def _work(self, llama: CountingLlama, stats: GenerationStats, work: Work, param: str,
              emit: Callable[[tuple[str, Any]], None], release: Callable[[CountingLlama], None]) -> None:
        def recorded(used: CountingLlama) -> None:
            self.recent.append(stats)
            release(used)

        super()._work(llama, stats, work, param, emit, recorded)
