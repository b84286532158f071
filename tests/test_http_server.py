"""The uvicorn server of every listener (src/darkbloom/http_server.py): a tick a second, a stop asked
from another thread or by the embedding program ends it without waiting for a tick, and a stopping
server freezes what it holds out of the garbage collector's reach."""

from __future__ import annotations

import gc
import signal
import threading
import time

import uvicorn

from darkbloom.http_server import Server


async def _app(scope: dict, receive: object, send: object) -> None:  # a do-nothing ASGI app
    if scope["type"] == "lifespan":
        return


class _Counting(Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config, own_signals=False)
        self.ticks: list[int] = []

    async def on_tick(self, counter: int) -> bool:
        self.ticks.append(counter)
        return await super().on_tick(counter)


def _started(server: Server) -> threading.Thread:
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    assert server.started
    return thread


def test_a_stop_asked_from_another_thread_ends_the_server_and_every_tick_refreshes_the_date() -> None:
    frozen = gc.get_freeze_count()
    server = _Counting(uvicorn.Config(_app, host="127.0.0.1", port=0, lifespan="off", log_config=None))
    thread = _started(server)
    server.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive(), "the server did not stop"
    assert server.ticks and all(counter % 10 == 0 for counter in server.ticks)  # uvicorn's once-a-second branch
    assert gc.get_freeze_count() == frozen  # not stopped by a signal: this process goes on


def test_a_server_stopped_by_a_signal_freezes_what_it_holds_before_closing_its_sockets() -> None:
    frozen = gc.get_freeze_count()
    server = Server(uvicorn.Config(_app, host="127.0.0.1", port=0, lifespan="off", log_config=None))
    thread = _started(server)  # (off the main thread uvicorn installs no handler; its own handler is called here)
    server.handle_exit(signal.SIGTERM, None)
    thread.join(timeout=30)
    assert not thread.is_alive(), "the server did not stop"
    try:
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()


def test_the_embedding_program_keeps_its_signals() -> None:
    before = signal.getsignal(signal.SIGTERM)
    server = Server(uvicorn.Config(_app), own_signals=False)
    with server.capture_signals():
        assert signal.getsignal(signal.SIGTERM) is before
