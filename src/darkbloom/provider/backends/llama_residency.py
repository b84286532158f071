"""Which of the llama.cpp backend's pools are in memory: loaded on demand, unloaded when idle.

Every model has a chat pool and an embeddings pool (`llama_cpp`), each a `Resident` here with the
memory it needs (`memory_fit`; the two pools of one model map one file, counted once). A request
`lease`s its pool for as long as it uses it, from before the load to the moment its worker thread
hands the instance back. A pool not in memory loads on its first lease; leases arriving meanwhile
wait for the same load. A pool nobody leases unloads `keep_alive` seconds after its last lease ended
(0: at once; negative: never while idle). When a load needs memory that idle pools hold, they unload
least recently used first; pools with leases are never unloaded, so a load that cannot fit beside
them waits until one of them goes idle. A pool that cannot fit even alone fails its lease at once.

Unloading closes a pool's `Llama` instances on the event loop, and only while nobody leases it, so
no worker thread holds one of them. Loads run on their own task: a lease cancelled while it waits
stops waiting, and the load finishes anyway (the pool is then idle, and its keep-alive runs).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.backends.llama_instances import Pool
from darkbloom.provider.memory_fit import MemoryBudget, MemoryNeed, PoolKind, size_text, too_large_message

log = logging.getLogger(__name__)

OpenPool = Callable[[str, PoolKind], Awaitable[Pool]]


@dataclass(eq=False)
class Resident:
    model_id: str
    kind: PoolKind
    need: MemoryNeed
    pool: Pool | None = None
    loading: asyncio.Task[Pool] | None = None
    leases: int = 0
    last_used: float = 0.0
    expiry: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def in_memory(self) -> bool:
        return self.pool is not None or self.loading is not None

    @property
    def idle(self) -> bool:
        return self.pool is not None and self.loading is None and self.leases == 0


class Lease:
    """One request's hold on a loaded pool; `release` (once) when its instance is back in the pool."""

    def __init__(self, residency: Residency, resident: Resident, pool: Pool) -> None:
        self.pool = pool
        self._residency, self._resident = residency, resident
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._residency.end_lease(self._resident)


class Residency:
    def __init__(self, needs: Iterable[tuple[PoolKind, MemoryNeed]], open_pool: OpenPool, budget: MemoryBudget,
                 keep_alive: float) -> None:
        self._residents = {(need.model_id, kind): Resident(need.model_id, kind, need) for kind, need in needs}
        self._open_pool = open_pool
        self.budget = budget
        self.keep_alive = keep_alive
        self._watchers: list[Callable[[], None]] = []
        self._changed = asyncio.Event()  # replaced at every change: waiters for memory look again
        self._closed = False

    def watch(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the event loop after every load and unload."""
        self._watchers.append(callback)

    def loaded_models(self) -> list[str]:
        """Model ids with a pool in memory now (a load in progress does not count yet), in config order."""
        return list(dict.fromkeys(r.model_id for r in self._residents.values() if r.pool is not None))

    def pool(self, model_id: str, kind: PoolKind) -> Pool | None:
        """The pool if it is loaded now."""
        return self._residents[(model_id, kind)].pool

    async def preload(self, model_id: str) -> bool:
        """Load `model_id`'s chat pool now if it fits beside what is loaded, unloading nothing; whether
        it is loaded. Its keep-alive starts now. With keep_alive 0 nothing is preloaded."""
        resident = self._residents[(model_id, "chat")]
        if self.keep_alive == 0 or resident.in_memory or not self._fits(self._in_memory() | {resident}):
            return resident.pool is not None
        await self._start_load(resident)
        return True

    async def lease(self, model_id: str, kind: PoolKind) -> Lease:
        """The pool, loaded (waiting for its load, and for memory to load it in)."""
        resident = self._residents[(model_id, kind)]
        resident.leases += 1
        self._keep(resident)
        try:
            pool = await self._ready(resident)
        except BaseException:
            self.end_lease(resident)
            raise
        return Lease(self, resident, pool)

    def end_lease(self, resident: Resident) -> None:
        resident.leases -= 1
        resident.last_used = time.monotonic()
        if resident.leases == 0 and resident.pool is not None:
            self._expire_later(resident)
        self._notify()  # a load waiting for memory may unload this pool now

    async def close(self) -> None:
        """Unload everything (the caller has stopped every request); waits for loads in progress."""
        self._closed = True
        self._notify()  # leases waiting for memory give up
        loads = [r.loading for r in self._residents.values() if r.loading is not None]
        await asyncio.gather(*loads, return_exceptions=True)
        for resident in self._residents.values():
            self._keep(resident)
            if resident.pool is not None:
                resident.pool.close()
                resident.pool = None

    # loading

    async def _ready(self, resident: Resident) -> Pool:
        while True:
            if self._closed:
                raise BackendError(503, "the llama.cpp backend is shut down")
            if resident.pool is not None:
                return resident.pool
            if resident.loading is not None:
                await asyncio.shield(resident.loading)
                continue
            if not self._fits({resident}):
                raise BackendError(503, too_large_message(resident.need, self.budget, resident.kind))
            if self._make_room(resident):
                await self._start_load(resident)
                continue
            changed = self._changed
            await changed.wait()

    async def _start_load(self, resident: Resident) -> Pool:
        task = asyncio.create_task(self._load(resident), name=f"load-{resident.model_id}-{resident.kind}")
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # seen even if nobody waits
        resident.loading = task
        return await asyncio.shield(task)

    async def _load(self, resident: Resident) -> Pool:
        started = time.monotonic()
        try:
            pool = await self._open_pool(resident.model_id, resident.kind)
        finally:
            resident.loading = None
            self._notify()
        if self._closed:
            pool.close()
            raise BackendError(503, "the llama.cpp backend is shut down")
        resident.pool, resident.last_used = pool, time.monotonic()
        log.info("model %s loaded (%s pool) in %.2f s; it needs %s", resident.model_id, resident.kind,
                 resident.last_used - started, resident.need.describe())
        self._changed_loaded()
        if resident.leases == 0:  # a preload, or every request waiting for it was cancelled
            self._expire_later(resident)
        return pool

    def _make_room(self, resident: Resident) -> bool:
        """Unload idle pools, least recently used first, until `resident` fits; False (unloading
        nothing) when it would not fit even with every idle pool gone."""
        loaded = self._in_memory()
        idle = sorted((r for r in loaded if r.idle), key=lambda r: r.last_used)
        if not self._fits(loaded - set(idle) | {resident}):
            return False
        for victim in idle:
            if self._fits(self._in_memory() | {resident}):
                break
            self._unload(victim, f"to make room for {resident.model_id}")
        return True

    # unloading

    def _expire_later(self, resident: Resident) -> None:
        self._keep(resident)
        if self.keep_alive == 0:
            self._unload(resident, "its request ended (keep-alive 0)")
        elif 0 < self.keep_alive < math.inf:
            resident.expiry = asyncio.get_running_loop().call_later(self.keep_alive, self._expire, resident)

    def _expire(self, resident: Resident) -> None:
        resident.expiry = None
        if resident.idle:
            self._unload(resident, f"idle for {self.keep_alive:g} s")

    def _keep(self, resident: Resident) -> None:
        if resident.expiry is not None:
            resident.expiry.cancel()
            resident.expiry = None

    def _unload(self, resident: Resident, reason: str) -> None:
        assert resident.idle and resident.pool is not None
        self._keep(resident)
        pool, resident.pool = resident.pool, None
        pool.close()
        log.info("model %s unloaded (%s pool): %s", resident.model_id, resident.kind, reason)
        self._changed_loaded()

    # memory

    def _in_memory(self) -> set[Resident]:
        return {r for r in self._residents.values() if r.in_memory}

    def _fits(self, residents: set[Resident]) -> bool:
        if self.budget.total_bytes <= 0:  # the machine's memory is unknown: no limit
            return True
        return _bytes(residents) <= self.budget.total_bytes

    def used_text(self) -> str:
        return f"{size_text(_bytes(self._in_memory()))} of {self.budget.describe()}"

    # changes

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _changed_loaded(self) -> None:
        self._notify()
        for callback in self._watchers:
            callback()


def _bytes(residents: set[Resident]) -> int:
    """Memory of these pools: each file once (a model's two pools map the same file), every context."""
    files = {r.model_id: r.need.file_bytes for r in residents}
    return sum(files.values()) + sum(r.need.context_bytes for r in residents)
