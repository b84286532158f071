"""Racing a request's work against the client going away (vLLM's ``with_cancellation``).

One watcher task per request listens for ``http.disconnect`` while the watch is open (``with
DisconnectWatch(request) as watch:``); while the handler runs a piece of work inside ``with
watch.race():``, a disconnect cancels that work in place (the handler's own task: no task per await)
and the block raises ``ClientDisconnected``. The watcher starts once the work has taken
``WATCH_AFTER``: a request answered sooner (most, on an idle model) never makes one, and a client gone
before then is noticed then (its disconnect waits in the server's queue), having cost at most that
much more work.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Iterator

from starlette.requests import Request

WATCH_AFTER = 0.02  # seconds


class ClientDisconnected(Exception):
    """The client closed the connection while its request was being worked on."""


class DisconnectWatch:
    def __init__(self, request: Request) -> None:
        self._request = request
        self._watcher: asyncio.Task[None] | None = None
        self._starting: asyncio.TimerHandle | None = None  # the watcher's start, until it is made
        self._waiting: asyncio.Task[Any] | None = None  # the task inside ``race`` now
        self._cancelled_it = False
        self.gone = False

    @contextlib.contextmanager
    def race(self) -> Iterator[None]:
        """Run the block unless the client goes away first: then it is cancelled where it waits and
        raises ClientDisconnected (at once, without running, when the client has gone already)."""
        if self.gone:
            raise ClientDisconnected()
        if self._starting is None:
            self._starting = asyncio.get_running_loop().call_later(WATCH_AFTER, self._start)
        task = asyncio.current_task()
        assert task is not None
        self._waiting = task
        try:
            yield
        except asyncio.CancelledError:
            if self._cancelled_it:
                self._cancelled_it = False
                if task.uncancel() == 0:  # our cancel alone: the client left; any other one stands
                    raise ClientDisconnected() from None
            raise
        finally:
            self._waiting = None
        if self._cancelled_it:  # the work swallowed our cancel (wait_for on 3.11 can): still gone
            self._cancelled_it = False
            task.uncancel()
            raise ClientDisconnected()

    def __enter__(self) -> "DisconnectWatch":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()  # a streamed answer's own response notices a client that goes away later

    def close(self) -> None:
        if self._starting is not None:  # a cancelled start never runs
            self._starting.cancel()
        if self._watcher is not None:
            self._watcher.cancel()

    def _start(self) -> None:
        self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while (await self._request.receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._waiting is not None:
            self._cancelled_it = True
            self._waiting.cancel()
