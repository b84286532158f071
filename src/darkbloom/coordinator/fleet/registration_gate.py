"""RegistrationGate: at most ``limit`` provider sockets registering at once (accepted, not yet
``registered``); a socket beyond it is closed at once with 1013 "try again later", which a node
takes as a refusal and retries with backoff (docs/protocol.md "Reconnecting").

Under a reconnect storm a refusal in a millisecond beats a registration that queues behind
thousands of others until the node's connect or the coordinator's deadlines run out: those who are
admitted register in bounded time, the others come back spread out by their backoff.
"""

from __future__ import annotations

from prometheus_client import Counter

TRY_AGAIN_LATER = 1013
REGISTRATIONS_IN_FLIGHT = 256
TURNED_AWAY = Counter("darkbloom_registrations_turned_away_total",
                      "Provider sockets closed with 1013 (try again later): too many registrations in flight")


class RegistrationGate:
    def __init__(self, limit: int = REGISTRATIONS_IN_FLIGHT) -> None:
        self.limit = limit
        self.in_flight = 0

    def enter(self) -> "Registering | None":
        """A place among the registrations in flight, or None (the caller closes with 1013)."""
        if self.in_flight >= self.limit:
            TURNED_AWAY.inc()
            return None
        self.in_flight += 1
        return Registering(self)


class Registering:
    """One registration's place at the gate; ``done`` (idempotent) gives it back."""

    def __init__(self, gate: RegistrationGate) -> None:
        self._gate: RegistrationGate | None = gate

    def done(self) -> None:
        if self._gate is not None:
            self._gate.in_flight -= 1
            self._gate = None
