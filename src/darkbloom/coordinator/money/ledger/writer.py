"""The ledger writer: one per coordinator process, the only path by which requests move money.

Callers ``submit`` steps (reservations, settlements, refunds — ``rules``) and await their own
results. One task takes every step queued at that moment and applies them, in arrival order, in
ONE transaction (group commit): while a batch commits, the next one queues up, so under load a
commit carries many requests and when idle a step goes alone at once. A refused step (402) is just
that step's result; it never aborts the batch.

A batch that fails (database gone, locked, a unique-key race between replicas) is retried whole —
every step is idempotent on its request id, so a retry after an unknown commit outcome is safe. If
it keeps failing, each step is tried alone so that one bad step cannot sink the others; a step
that still fails raises ``LedgerUnavailable`` to its caller.

When the process is ``quiet`` (it serves one request and nothing else) and the writer is idle, a
step is first offered to the backend's ``apply_now`` as it is submitted: SQLite applies one that need
not wait (``sqlite.py``) at once on the loop's thread, and its caller goes on without a turn of the
loop or a hop to the writer's thread and back; anything else, and every step under load, is queued
as above (on SQLite, for its own thread, where its work overlaps the loop's).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Callable, Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.coordinator.money.ledger.rules import Step

log = logging.getLogger("darkbloom.ledger")
MAX_BATCH = 512
BATCH_ATTEMPTS = 4
RETRY_DELAY = 0.05  # seconds, doubled after each failed attempt


class LedgerUnavailable(Exception):
    """The database could not apply a ledger step after retries."""


class Backend(Protocol):
    async def apply(self, steps: list[Step]) -> list[Any]: ...

    def apply_now(self, steps: list[Step]) -> list[Any] | None: ...  # None: not without waiting

    async def close(self) -> None: ...


def backend_for(engine: AsyncEngine) -> Backend:
    if engine.dialect.name == "sqlite":
        from darkbloom.coordinator.money.ledger.sqlite import SqliteLedger

        return SqliteLedger(engine.url.database or "")
    from darkbloom.coordinator.money.ledger.postgres import PostgresLedger

    return PostgresLedger(engine)


class LedgerWriter:
    def __init__(self, engine: AsyncEngine | None = None, backend: Backend | None = None,
                 max_batch: int = MAX_BATCH, quiet: Callable[[], bool] = lambda: False) -> None:
        self._engine = engine
        self._backend = backend
        self.max_batch = max_batch
        self._quiet = quiet  # whether a batch may be applied on the loop's thread (``apply_now``)
        self._queue: collections.deque[tuple[Step, asyncio.Future[Any]]] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._applying = False  # a batch is on its way to the database
        self.batches = 0  # committed batches and the steps they carried (for the bench)
        self.steps = 0

    def submit(self, step: Step) -> asyncio.Future[Any]:
        """Queue a step; the future resolves to its result once its batch has committed."""
        if self._closed:
            raise LedgerUnavailable("the ledger writer is closed (the coordinator is shutting down)")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._queue and not self._applying and self._quiet():
            results = self._apply_now([step])
            if results is not None:
                future.set_result(results[0])
                return future
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="ledger-writer")
        self._queue.append((step, future))
        assert self._wake is not None
        self._wake.set()
        return future

    async def run(self, step: Step) -> Any:
        return await self.submit(step)

    async def close(self) -> None:
        """Apply what is queued, then stop; later submits raise ``LedgerUnavailable``."""
        self._closed = True
        task = self._task
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            assert self._wake is not None
            self._wake.set()
            await task
        backend, self._backend = self._backend, None
        if backend is not None:
            try:
                await backend.close()
            except Exception:  # noqa: BLE001 - closing a broken connection: nothing left to save
                log.warning("closing the ledger writer's connection failed", exc_info=True)

    def _backend_now(self) -> Backend:
        if self._backend is None:
            if self._engine is None:
                raise LedgerUnavailable("no database: these services were built without an engine")
            self._backend = backend_for(self._engine)
        return self._backend

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            if not self._queue:
                if self._closed:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
            self._applying = True
            try:
                await self._apply(batch)
            except BaseException as exc:  # cancelled (shutdown) or a bug: no caller may wait forever
                for _, future in batch:
                    if not future.done():
                        future.set_exception(LedgerUnavailable(f"the ledger writer stopped: {exc!r}"))
                raise
            finally:
                self._applying = False

    def _apply_now(self, steps: list[Step]) -> list[Any] | None:
        """The steps applied at once, or None: the backend would have to wait, or failed (rolled back;
        the queue's retries take the steps over)."""
        try:
            results = self._backend_now().apply_now(steps)
        except Exception:  # noqa: BLE001 - retried through the queue, which reports what persists
            log.debug("a ledger step applied at once failed; queued instead", exc_info=True)
            return None
        if results is not None:
            self.batches += 1
            self.steps += len(steps)
        return results

    async def _apply(self, batch: list[tuple[Step, asyncio.Future[Any]]], attempts: int = BATCH_ATTEMPTS) -> None:
        steps = [step for step, _ in batch]
        error: BaseException | None = None
        for attempt in range(attempts):
            try:
                results = await self._backend_now().apply(steps)
            except Exception as exc:  # noqa: BLE001 - retried, then reported to each caller
                error = exc
                log.warning("ledger batch of %d steps failed (attempt %d of %d): %r", len(steps), attempt + 1,
                            attempts, exc)
                if attempt + 1 < attempts:
                    await asyncio.sleep(RETRY_DELAY * 2 ** attempt)
                continue
            self.batches += 1
            self.steps += len(steps)
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)
            return
        if len(batch) > 1:  # one step may be what fails the batch: give every other step its chance
            for item in batch:
                await self._apply([item], attempts=1)
            return
        _, future = batch[0]
        if not future.done():
            failure = LedgerUnavailable(f"the ledger step could not be written: {error!r}")
            failure.__cause__ = error
            future.set_exception(failure)
