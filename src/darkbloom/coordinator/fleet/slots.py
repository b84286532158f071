"""Provider slots: the one place a session's ``active`` count changes.

``Slots.claim`` takes one of a session's ``max_concurrency`` slots and returns the ``Slot``; its
``release`` (idempotent) gives it back and wakes whoever waits for a free slot (the request
queues subscribe with ``on_release``), so no caller has to remember to drain a queue.
"""

from __future__ import annotations

from typing import Callable

from darkbloom.coordinator.fleet.session import ProviderSession


class Slot:
    __slots__ = ("session", "_book", "released")

    def __init__(self, session: ProviderSession, book: "Slots") -> None:
        self.session = session
        self._book = book
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._book._give_back(self)


class Slots:
    def __init__(self) -> None:
        self._listeners: list[Callable[[], None]] = []

    def on_release(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def claim(self, session: ProviderSession) -> Slot:
        session._active += 1
        return Slot(session, self)

    def _give_back(self, slot: Slot) -> None:
        slot.session._active -= 1
        for listener in self._listeners:
            listener()
