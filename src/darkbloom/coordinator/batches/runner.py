"""Running batches: every coordinator runs one ``BatchRunner``, which takes lines of open batches with a
lease in the database and serves each as one request (``inference.serving.serve_line``: the route the
batch was made with, the lowest priority, a reservation and settlement per line). A line's answer is
kept (conditional on the lease) before it settles, so a line is answered at most once and charged only
by the attempt that answered it; a coordinator that stops or dies leaves its lines to be taken over
when their leases run out. The runner also ends batches: cancelled or expired lines not yet running,
then the result files, written by whichever coordinator wins the batch's ``finalizing``.

A line that finds no machine to run on — offline, busy, unlinked, no provider, a slot not freed in
time — waits, pending, and is tried again (until the completion window ends); one that fails as a live
request fails (a 4xx, or a provider failing it three times) is written to the error file."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from darkbloom.coordinator.batches import results
from darkbloom.coordinator.batches.batch_api import route_headers
from darkbloom.coordinator.batches.input_file import BATCH_EDGES
from darkbloom.coordinator.identity.api_keys import ApiKey
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.inference.serving import serve_line
from darkbloom.coordinator.money.billing import FULL_PRICE_BPS, BatchTerms
from darkbloom.coordinator.routing import route
from darkbloom.coordinator.services import Services
from darkbloom.store import batches, keys
from darkbloom.wire.openai.errors import ApiError, unauthorized

log = logging.getLogger("darkbloom.batches")
_WAITS = {409, 429, 503}          # no machine to run on now: the line waits …
_FAILS = {"model_not_loaded"}     # … but for the caller's online machines not serving its model at all
_PROVIDER_FAILURES = 3            # attempts a line may fail on providers (5xx) before it fails
_FINALIZING_STALE = 120           # seconds after which another coordinator takes over a batch's finalizing


class _LeaseLost(Exception):
    """The line is no longer this coordinator's (its lease ran out and another took it over)."""


class BatchRunner:
    def __init__(self, services: Services) -> None:
        self.services = services
        self._lines: dict[str, set[asyncio.Task[None]]] = {}  # batch id → its lines running here
        self._unplaced: set[asyncio.Task[None]] = set()  # of those, the lines still waiting for a slot
        self._renewed: dict[str, float] = {}

    async def run_forever(self) -> None:
        try:
            while True:
                try:
                    await self.step()
                except Exception:  # noqa: BLE001 - a database hiccup: the next round tries again
                    log.exception("batch round failed")
                await asyncio.sleep(self.services.settings.batch_poll_interval)
        finally:
            running = [task for tasks in self._lines.values() for task in tasks]
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def step(self) -> None:
        """One round over the open batches: end, take lines, renew leases, finalize."""
        async with self.services.engine.connect() as conn:
            open_batches = await batches.open_batches(conn)
        for batch in open_batches:
            await self._step(batch, int(time.time()))

    async def _step(self, batch: dict[str, Any], now: int) -> None:
        batch_id, status, engine = batch["id"], batch["status"], self.services.engine
        here = self._lines.get(batch_id, set())
        if not here:
            self._lines.pop(batch_id, None)
            self._renewed.pop(batch_id, None)
        if status == "finalizing":
            if batch["finalizing_at"] < now - _FINALIZING_STALE:
                await self._finalize(batch, "finalizing", now, stale_before=now - _FINALIZING_STALE)
            return
        ending = "cancelled" if status == "cancelling" else "expired" if now >= batch["expires_at"] else None
        if ending is not None:
            for task in here & self._unplaced:
                task.cancel()  # not started yet: put back, then ended with the rest
        async with engine.begin() as conn:
            if ending is not None:
                await batches.end_unstarted(conn, batch_id, ending, now)
            elif status == "validating":
                await batches.set_status(conn, batch_id, "validating", "in_progress", in_progress_at=now)
            if here and time.monotonic() - self._renewed.get(batch_id, 0) > self.services.settings.batch_lease_seconds / 3:
                await batches.renew(conn, batch_id, self.services.instance_id, now + self._lease())
                self._renewed[batch_id] = time.monotonic()
            room = 0 if ending else self.services.settings.batch_lines_in_flight - len(here)
            claimed = await batches.claim(conn, batch_id, self.services.instance_id, now, now + self._lease(),
                                          room) if room > 0 else []
            unfinished = await batches.unfinished(conn, batch_id) if not claimed and not here else None
        if claimed:
            caller = await self._caller(batch)
            for line in claimed:
                self._start(batch, caller, line)
        elif unfinished == 0:
            await self._finalize(batch, status, now)

    def _lease(self) -> int:
        return int(self.services.settings.batch_lease_seconds) + 1

    async def _finalize(self, batch: dict[str, Any], status: str, now: int, stale_before: int | None = None) -> None:
        async with self.services.engine.begin() as conn:
            won = await batches.set_status(conn, batch["id"], status, "finalizing", finalizing_at=now,
                                           stale_before=stale_before)
        if won and await results.finalize(self.services, batch):
            log.info("batch %s finalized", batch["id"])

    async def _caller(self, batch: dict[str, Any]) -> Caller | ApiError:
        """Who the batch's lines run as — its creator, re-read now (a key deleted, disabled or expired
        since: each line gets the 401 a live request would)."""
        kind = batch["caller_kind"]
        if kind != "api_key":
            return Caller(batch["account_id"], kind, machine_id=batch["machine_id"])
        async with self.services.engine.connect() as conn:
            row = await keys.get(conn, batch["account_id"], batch["key_id"])
        if row is None:
            return unauthorized("The API key that created this batch has been deleted.")
        key = ApiKey.from_row(row)
        return key.refusal() or Caller(batch["account_id"], "api_key", key=key)

    def _start(self, batch: dict[str, Any], caller: Caller | ApiError, line: dict[str, Any]) -> None:
        def placed() -> None:
            self._unplaced.discard(task)

        task = asyncio.get_running_loop().create_task(self._run(batch, caller, line, placed))
        tasks = self._lines.setdefault(batch["id"], set())
        tasks.add(task)
        self._unplaced.add(task)
        task.add_done_callback(tasks.discard)
        task.add_done_callback(self._unplaced.discard)

    async def _run(self, batch: dict[str, Any], caller: Caller | ApiError, line: dict[str, Any],
                   placed: Callable[[], None]) -> None:
        services, batch_id = self.services, batch["id"]
        line_no, custom_id, attempt = line["line_no"], line["custom_id"], line["attempts"]
        edge = BATCH_EDGES[batch["endpoint"]]
        request_id = results.request_id(batch_id, custom_id, attempt, edge.id_prefix)
        owner = services.instance_id

        async def answered(body: dict[str, Any]) -> None:
            async with services.engine.begin() as conn:
                if not await batches.finish(conn, batch_id, line_no, owner, attempt, "answered", request_id,
                                            results.answer_line(batch_id, custom_id, request_id, body),
                                            int(time.time())):
                    raise _LeaseLost

        try:
            if isinstance(caller, ApiError):
                raise caller
            policy = route.resolve_policy(route_headers(batch), caller)
            terms = BatchTerms(batch_id, custom_id, round(services.settings.batch_discount * FULL_PRICE_BPS))
            await serve_line(edge, caller, services, line["body"].encode(), policy, request_id, terms, placed,
                             answered)
        except _LeaseLost:
            log.warning("batch %s line %d: its lease was lost before its answer was kept; not charged", batch_id,
                        line_no)
        except ApiError as error:
            await self._failed(batch, line, request_id, error)
        except asyncio.CancelledError:  # this coordinator is stopping, or the line not started is ending: put back
            await asyncio.shield(services.spawn(self._put_back(batch_id, line_no, attempt, 0)))
            raise
        except Exception:  # noqa: BLE001 - a bug or the database: the line is tried again later
            log.exception("batch %s line %d failed unexpectedly; it will be tried again", batch_id, line_no)
            await self._put_back(batch_id, line_no, attempt, int(time.time() + services.settings.batch_retry_seconds))

    async def _failed(self, batch: dict[str, Any], line: dict[str, Any], request_id: str, error: ApiError) -> None:
        now = int(time.time())
        batch_id, line_no, attempt = batch["id"], line["line_no"], line["attempts"]
        provider_failure = error.status >= 500 and error.status not in _WAITS and attempt < _PROVIDER_FAILURES
        if (error.status in _WAITS and error.code not in _FAILS) or provider_failure:  # (past the window, the next round expires it)
            log.info("batch %s line %d waits: %s", batch_id, line_no, error.code)
            await self._put_back(batch_id, line_no, attempt, int(now + self.services.settings.batch_retry_seconds))
            return
        async with self.services.engine.begin() as conn:
            await batches.finish(conn, batch_id, line_no, self.services.instance_id, attempt, "failed", request_id,
                                 results.error_line(batch_id, line["custom_id"], request_id, error), now)

    async def _put_back(self, batch_id: str, line_no: int, attempt: int, not_before: int) -> None:
        try:
            async with self.services.engine.begin() as conn:
                await batches.put_back(conn, batch_id, line_no, self.services.instance_id, attempt, not_before)
        except Exception:  # noqa: BLE001 - its lease runs out and it is taken over then
            log.exception("batch %s line %d could not be put back", batch_id, line_no)
