"""RegistrationGate: at most ``limit`` provider sockets registering at once (accepted, not yet
``registered``); a socket beyond it is closed at once with 1013 "try again later", which a node
takes as a refusal and retries with backoff (docs/protocol.md "Reconnecting").

A safety valve, not a throttle: a registration costs a millisecond or two of this process's one
loop, so 1,024 in flight is a second or two of queued work, and a storm the node's reconnect policy
spreads stays below it (bench/fleet_scale.py's storms: none turned away at this limit; a quarter of
it turned nodes away for no faster convergence; bench/RESULTS.md). Past it, queued registrations would wait behind thousands of others until the
coordinator's own deadlines (the first challenge's 30 s) ran out on them; a refusal in a
millisecond, retried with backoff, is better.
"""

from __future__ import annotations

from prometheus_client import Counter

TRY_AGAIN_LATER = 1013
REGISTRATIONS_IN_FLIGHT = 1024
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
