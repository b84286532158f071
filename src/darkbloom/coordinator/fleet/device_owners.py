"""DeviceOwners: who owns the device token a node registers with, looked up for every registration
waiting at that moment in ONE query.

A lookup of its own costs a registration a pool checkout (with its ping), a transaction and a
statement: a third of the coordinator's CPU per registration when a whole fleet reconnects. Here a
registration asks, and while one query runs the others that arrive wait for the next, which takes
them all (up to ``MAX_BATCH`` token hashes per statement): alone, a registration pays what it paid
before; in a storm, hundreds share one round trip. Nothing is cached, so a revoked token or an
unlinked machine is seen by the next registration, as before.
"""

from __future__ import annotations

import asyncio

from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.store import devices

MAX_BATCH = 500  # token hashes per statement (well under every backend's limit on parameters)
Owner = tuple[str, str]  # (account_id, machine_id)


class DeviceOwners:
    def __init__(self, engine: AsyncEngine | None) -> None:
        self._engine = engine
        self._waiting: dict[str, list[asyncio.Future[Owner | None]]] = {}
        self._lookup: asyncio.Task[None] | None = None

    async def owner(self, token_hash: str) -> Owner | None:
        """The (account_id, machine_id) of a live device token of a linked machine, or None."""
        answer: asyncio.Future[Owner | None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(token_hash, []).append(answer)
        if self._lookup is None:
            self._lookup = asyncio.get_running_loop().create_task(self._look_up(), name="device-owners")
        return await answer

    async def _look_up(self) -> None:
        batch: dict[str, list[asyncio.Future[Owner | None]]] = {}
        try:
            while self._waiting:
                hashes = list(self._waiting)[:MAX_BATCH]
                batch = {token_hash: self._waiting.pop(token_hash) for token_hash in hashes}
                try:
                    if self._engine is None:
                        raise RuntimeError("no database: these services were built without an engine")
                    async with self._engine.connect() as conn:
                        owners = await devices.token_owners(conn, hashes)
                except Exception as exc:  # noqa: BLE001 - each waiting registration fails as its own query would
                    _settle(batch, exc)
                else:
                    for token_hash, answers in batch.items():
                        for answer in answers:
                            if not answer.done():
                                answer.set_result(owners.get(token_hash))
        finally:
            self._lookup = None
            # cancelled (the process is stopping): nobody is left waiting
            _settle(batch, None)
            _settle(self._waiting, None)
            self._waiting = {}


def _settle(batch: dict[str, list[asyncio.Future[Owner | None]]], error: BaseException | None) -> None:
    for answers in batch.values():
        for answer in answers:
            if not answer.done():
                if error is None:
                    answer.cancel()
                else:
                    answer.set_exception(error)
