"""Which of an in-process backend's engines are in memory: loaded on demand, unloaded when idle.

Every model has its engines — llama.cpp: a chat engine and an embeddings engine (`llama_cpp`);
MLX: a chat engine (`mlx_backend`) —, each a `Resident` here with the memory it needs (`memory_fit`;
two engines of one model map its weights once, counted once). A
request `lease`s its engine for as long as it uses it, from before the load to the moment the engine
lets go of the request. An engine not in memory loads on its first lease; leases arriving meanwhile
wait for the same load. An engine nobody leases unloads `keep_alive` seconds after its last lease
ended (0: at once; negative: never while idle). When a load needs memory that idle engines hold,
they unload least recently used first; engines with leases are never unloaded, so a load that cannot
fit beside them waits until one of them goes idle. An engine that cannot fit even alone fails its
lease at once.

Unloading closes an engine (its thread stops, its context and model are freed) on the event loop,
and only while nobody leases it. Loads run on their own task: a lease cancelled while it waits
stops waiting, and the load finishes anyway (the engine is then idle, and its keep-alive runs).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, Iterable, Protocol, TypeVar

from darkbloom.provider.backends.base import BackendError
from darkbloom.provider.memory_fit import MemoryBudget, MemoryNeed, EngineKind, size_text, too_large_message

log = logging.getLogger(__name__)


class Closeable(Protocol):
    def close(self) -> None:
        """Stop the engine's work and free its model (blocking)."""


Engines = TypeVar("Engines", bound=Closeable)
OpenEngine = Callable[[str, EngineKind], Awaitable[Engines]]
SHUT_DOWN = "the backend is shut down"


@dataclass(eq=False)
class Resident(Generic[Engines]):
    model_id: str
    kind: EngineKind
    need: MemoryNeed
    engine: Engines | None = None
    loading: "asyncio.Task[Engines] | None" = None
    leases: int = 0
    last_used: float = 0.0
    expiry: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def in_memory(self) -> bool:
        return self.engine is not None or self.loading is not None

    @property
    def idle(self) -> bool:
        return self.engine is not None and self.loading is None and self.leases == 0


class Lease(Generic[Engines]):
    """One request's hold on a loaded engine; `release` (once) when the engine has let go of the request."""

    def __init__(self, residency: Residency[Engines], resident: Resident[Engines], engine: Engines) -> None:
        self.engine = engine
        self._residency, self._resident = residency, resident
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._residency.end_lease(self._resident)


class Residency(Generic[Engines]):
    def __init__(self, needs: Iterable[tuple[EngineKind, MemoryNeed]], open_engine: OpenEngine[Engines],
                 budget: MemoryBudget, keep_alive: float) -> None:
        self._residents: dict[tuple[str, EngineKind], Resident[Engines]] = {
            (need.model_id, kind): Resident(need.model_id, kind, need) for kind, need in needs}
        self._open_engine = open_engine
        self.budget = budget
        self.keep_alive = keep_alive
        self._watchers: list[Callable[[], None]] = []
        self._changed = asyncio.Event()  # replaced at every change: waiters for memory look again
        self._closed = False

    def watch(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the event loop after every load and unload."""
        self._watchers.append(callback)

    def loaded_models(self) -> list[str]:
        """Model ids with an engine in memory now (a load in progress does not count yet), in config order."""
        return list(dict.fromkeys(r.model_id for r in self._residents.values() if r.engine is not None))

    def engine(self, model_id: str, kind: EngineKind) -> Engines | None:
        """The engine if it is loaded now."""
        return self._residents[(model_id, kind)].engine

    async def preload(self, model_id: str) -> bool:
        """Load `model_id`'s chat engine now if it fits beside what is loaded, unloading nothing; whether
        it is loaded. Its keep-alive starts now. With keep_alive 0 nothing is preloaded."""
        resident = self._residents[(model_id, "chat")]
        if self.keep_alive == 0 or resident.in_memory or not self._fits(self._in_memory() | {resident}):
            return resident.engine is not None
        await self._start_load(resident)
        return True

    async def lease(self, model_id: str, kind: EngineKind) -> Lease[Engines]:
        """The engine, loaded (waiting for its load, and for memory to load it in)."""
        resident = self._residents[(model_id, kind)]
        resident.leases += 1
        self._keep(resident)
        try:
            engine = await self._ready(resident)
        except BaseException:
            self.end_lease(resident)
            raise
        return Lease(self, resident, engine)

    def end_lease(self, resident: Resident[Engines]) -> None:
        resident.leases -= 1
        resident.last_used = time.monotonic()
        if resident.leases == 0 and resident.engine is not None:
            self._expire_later(resident)
        self._notify()  # a load waiting for memory may unload this engine now

    async def close(self) -> None:
        """Unload everything (the caller has stopped every request); waits for loads in progress."""
        self._closed = True
        self._notify()  # leases waiting for memory give up
        loads = [r.loading for r in self._residents.values() if r.loading is not None]
        await asyncio.gather(*loads, return_exceptions=True)
        for resident in self._residents.values():
            self._keep(resident)
            if resident.engine is not None:
                resident.engine.close()
                resident.engine = None

    # loading

    async def _ready(self, resident: Resident[Engines]) -> Engines:
        while True:
            if self._closed:
                raise BackendError(503, SHUT_DOWN)
            if resident.engine is not None:
                return resident.engine
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

    async def _start_load(self, resident: Resident[Engines]) -> Engines:
        task = asyncio.create_task(self._load(resident), name=f"load-{resident.model_id}-{resident.kind}")
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # seen even if nobody waits
        resident.loading = task
        return await asyncio.shield(task)

    async def _load(self, resident: Resident[Engines]) -> Engines:
        started = time.monotonic()
        try:
            engine = await self._open_engine(resident.model_id, resident.kind)
        finally:
            resident.loading = None
            self._notify()
        if self._closed:
            engine.close()
            raise BackendError(503, SHUT_DOWN)
        resident.engine, resident.last_used = engine, time.monotonic()
        log.info("model %s loaded (%s engine) in %.2f s; it needs %s", resident.model_id, resident.kind,
                 resident.last_used - started, resident.need.describe())
        self._changed_loaded()
        if resident.leases == 0:  # a preload, or every request waiting for it was cancelled
            self._expire_later(resident)
        return engine

    def _make_room(self, resident: Resident[Engines]) -> bool:
        """Unload idle engines, least recently used first, until `resident` fits; False (unloading
        nothing) when it would not fit even with every idle engine gone."""
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

    def _expire_later(self, resident: Resident[Engines]) -> None:
        self._keep(resident)
        if self.keep_alive == 0:
            self._unload(resident, "its request ended (keep-alive 0)")
        elif 0 < self.keep_alive < math.inf:
            resident.expiry = asyncio.get_running_loop().call_later(self.keep_alive, self._expire, resident)

    def _expire(self, resident: Resident[Engines]) -> None:
        resident.expiry = None
        if resident.idle:
            self._unload(resident, f"idle for {self.keep_alive:g} s")

    def _keep(self, resident: Resident[Engines]) -> None:
        if resident.expiry is not None:
            resident.expiry.cancel()
            resident.expiry = None

    def _unload(self, resident: Resident[Engines], reason: str) -> None:
        assert resident.idle and resident.engine is not None
        self._keep(resident)
        engine, resident.engine = resident.engine, None
        engine.close()
        log.info("model %s unloaded (%s engine): %s", resident.model_id, resident.kind, reason)
        self._changed_loaded()

    # memory

    def _in_memory(self) -> set[Resident[Engines]]:
        return {r for r in self._residents.values() if r.in_memory}

    def _fits(self, residents: set[Resident[Engines]]) -> bool:
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


def _bytes(residents: set[Resident[Engines]]) -> int:
    """Memory of these engines: each file once (a model's two engines map the same file), every context."""
    files = {r.model_id: r.need.file_bytes for r in residents}
    return sum(files.values()) + sum(r.need.context_bytes for r in residents)
