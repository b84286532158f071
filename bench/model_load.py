"""Load on demand: the first request to a model that is not in memory (it loads first) beside one to
a model already loaded, on the bundled SmolLM2-135M with the node's defaults (n_ctx 2048, four
sequences per engine). Two llama.cpp backends in this process: one keeps its model loaded, the other
runs with keep-alive 0, so every request to it loads the model and unloads it when it ends. Rounds
alternate between them so drift hits both alike. The file stays in the page cache between rounds:
this is the load from memory, not from a cold disk.

Time to first token = from the request to its first content chunk; the load alone is what the
backend logs for each load ("model … loaded … in N s"). Every request asks something new (its
number leads the message), so a loaded model reuses from its previous request only the chat
template's opening (the system prompt), as it would in real use.

Run: .venv/bin/python bench/model_load.py [--rounds 7] [--max-tokens 8]
Prints a table; record it in bench/RESULTS.md with the date and machine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from darkbloom.provider.backends.llama_cpp import LlamaCppBackend  # noqa: E402
from darkbloom.provider.bundled_model import bundled_gguf_path  # noqa: E402

MODEL = "smollm2-135m"
PROMPT = "Write a short poem about the sea."


class LoadTimes(logging.Handler):
    """The seconds of every "model … loaded … in N s" line the backend logs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("model %s loaded") and isinstance(record.args, tuple):
            self.seconds.append(float(record.args[2]))


async def first_token(backend: LlamaCppBackend, max_tokens: int, number: int) -> tuple[float, float]:
    """(time to first content chunk, total time) of one streamed chat completion."""
    messages = [{"role": "user", "content": f"{number}. {PROMPT}"}]
    started = time.perf_counter()
    first: float | None = None
    async for chunk in backend.stream_chat(MODEL, {"messages": messages, "max_tokens": max_tokens,
                                                   "temperature": 0}):
        if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
            first = time.perf_counter() - started
    assert first is not None, "no content"
    return first, time.perf_counter() - started


def row(name: str, values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return f"| {name} | {len(ms)} | {statistics.median(ms):,.0f} ms | {min(ms):,.0f}–{max(ms):,.0f} ms |"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=8)
    options = parser.parse_args()
    loads = LoadTimes()
    logging.getLogger("darkbloom.provider.backends.residency").addHandler(loads)
    logging.getLogger("darkbloom.provider.backends.residency").setLevel(logging.INFO)
    models = {MODEL: bundled_gguf_path()}
    loaded = LlamaCppBackend(models, keep_alive=-1)
    unloaded = LlamaCppBackend(models, keep_alive=0)
    await loaded.start()
    await unloaded.start()
    assert loaded.loaded_models() == [MODEL] and unloaded.loaded_models() == []
    await first_token(loaded, options.max_tokens, 0)  # warm-up: the loaded engine's first decode, the page cache
    await first_token(unloaded, options.max_tokens, 0)
    loads.seconds.clear()
    warm: list[tuple[float, float]] = []
    cold: list[tuple[float, float]] = []
    try:
        for number in range(1, options.rounds + 1):
            warm.append(await first_token(loaded, options.max_tokens, number))
            assert unloaded.loaded_models() == []
            cold.append(await first_token(unloaded, options.max_tokens, number))
    finally:
        await loaded.close()
        await unloaded.close()
    print(f"bench/model_load.py — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{platform.machine()}, {os.cpu_count()} cores; {MODEL} ({models[MODEL].stat().st_size / 2**20:.0f} MiB "
          f"GGUF), n_ctx 2048, max_concurrency {loaded.max_concurrency}, max_tokens {options.max_tokens}, "
          f"{options.rounds} rounds")
    print()
    print("| first request to the model | rounds | median | range |")
    print("|---|---|---|---|")
    print(row("loaded: time to first token", [first for first, _ in warm]))
    print(row("not loaded: time to first token (loads first)", [first for first, _ in cold]))
    print(row("not loaded: the load alone (backend log)", loads.seconds))
    print(row("loaded: whole answer", [total for _, total in warm]))
    print(row("not loaded: whole answer", [total for _, total in cold]))


if __name__ == "__main__":
    asyncio.run(main())
