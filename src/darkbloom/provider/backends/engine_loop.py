"""One thread that owns a loaded model and advances its requests, the same for every in-process engine
(llama.cpp's `llama_engine`, MLX's `mlx_engine`).

Requests are submitted from any thread into an inbox. The thread moves them to its waiting queue,
ends the cancelled ones, admits what fits, and takes one step while anything runs; it sleeps only
when nothing is waiting or running. A step that raises (a bug of ours, or the library refusing it)
ends the requests running, and the engine goes on. Closing ends every request still there as
cancelled. What a step is, what fits and how a request runs are the engine's own.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable, Generic, Protocol, TypeVar

from darkbloom.provider.backends.base import BackendError, Cancelled, Generation
from darkbloom.provider.backends.text_stream import Finish, Piece, TextStream, TokenLogprob

log = logging.getLogger(__name__)


class Work(Protocol):
    """One request as an engine runs it: its counts and cancel flag, the stream its tokens become text in,
    the sink that text goes to, and `finished`, called once, last."""

    @property
    def generation(self) -> Generation: ...

    @property
    def stream(self) -> TextStream: ...

    @property
    def sink(self) -> Callable[[Piece | Finish], None]: ...

    @property
    def finished(self) -> Callable[[BaseException | None], None]: ...


W = TypeVar("W", bound=Work)


class EngineLoop(Generic[W]):
    backend_name = "in-process"  # in messages and logs

    def __init__(self, thread_name: str) -> None:
        """The subclass starts `_thread` once its own state is ready."""
        self._waiting: collections.deque[W] = collections.deque()
        self._inbox: list[W] = []
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def submit(self, work: W) -> None:
        """Queue `work` (any thread); it ends at once, with a 503, when the engine is closing."""
        with self._wake:
            if not self._closing:
                self._inbox.append(work)
                self._wake.notify()
                return
        self._end(work, BackendError(503, f"the {self.backend_name} backend is shut down"))

    def close(self) -> None:
        """Stop the thread (every request still here ends as cancelled) and free the model."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        self._free()

    # the engine's thread

    def _run(self) -> None:
        if not self._open():
            return
        while True:
            with self._wake:
                while not (self._closing or self._inbox or self._waiting or self._running()):
                    self._wake.wait()
                if self._closing:
                    break
                self._waiting.extend(self._inbox)
                self._inbox.clear()
            try:
                for work in [w for w in self._waiting if w.generation.cancel.is_set()]:
                    self._waiting.remove(work)
                    self._end(work, Cancelled())
                self._cancel_running()
                self._admit()
                if self._running():
                    self._step()
            except Exception:
                log.exception("%s engine step failed", self.backend_name)
                self._abandon_step()
        for work in [*self._waiting, *self._inbox]:
            self._end(work, Cancelled())
        self._stop_running()
        self._closed()

    def _next_waiting(self) -> W:
        """The waiting request to admit next: a live one before a coordinator's batch line."""
        work = next((w for w in self._waiting if not w.generation.background), self._waiting[0])
        self._waiting.remove(work)
        return work

    def _hand_on(self, work: W, token: int, logprob: TokenLogprob | None) -> bool:
        """A sampled token through the request's stream to its sink, its counts published (a callback's
        exception is the caller's); whether its answer is over."""
        items = work.stream.push(token, logprob)
        work.generation.completion_tokens = work.stream.completion_tokens
        work.generation.sync_meter()
        for item in items:
            work.sink(item)
        return work.stream.done

    def _end(self, work: W, error: BaseException | None) -> None:
        try:
            work.finished(error)
        except Exception:
            log.exception("a request's end callback failed")

    # what each engine does

    def _open(self) -> bool:
        """On the thread, before anything runs: whether the engine may serve (False: the thread ends)."""
        return True

    def _running(self) -> bool:
        raise NotImplementedError

    def _cancel_running(self) -> None:
        """End the running requests whose cancel is set."""
        raise NotImplementedError

    def _admit(self) -> None:
        raise NotImplementedError

    def _step(self) -> None:
        raise NotImplementedError

    def _abandon_step(self) -> None:
        """After a step raised: end every running request with a 500 and leave the engine usable."""
        raise NotImplementedError

    def _stop_running(self) -> None:
        """At close: end every running request as cancelled."""
        raise NotImplementedError

    def _closed(self) -> None:
        """On the thread, after its last step (MLX frees its arrays on the thread that made them)."""

    def _free(self) -> None:
        """On the closing thread, once the engine's thread has ended."""
