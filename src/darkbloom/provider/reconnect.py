"""When a node dials its coordinator again: a policy that spreads a whole fleet's reconnections.

A coordinator that restarts drops every node at once; if they all came back after the same delay
they would reach the new process together, its accept queue would overflow and most attempts would
time out (docs/protocol.md "Reconnecting"). So, from how the last connection ended:

- a registered session closed with 1012 "service restart" or 1001 "going away" (the coordinator is
  stopping, and so are all its sessions): the next attempt at a uniformly random moment of
  ``restart_window``;
- a registered session lost any other way (a dropped network, an eviction): within ``lost_window``;
- no registration (refused, timed out, a broken handshake, closed before ``registered``, or 1013
  "try again later" from a coordinator taking too many registrations at once): exponential backoff
  with full jitter, a uniform delay up to ``base`` × 2^(failures − 1), capped at ``cap``;
- a registration resets the backoff.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

GOING_AWAY = 1001
SERVICE_RESTART = 1012
TRY_AGAIN_LATER = 1013
_STOPPING = frozenset({GOING_AWAY, SERVICE_RESTART})


@dataclass
class ReconnectPolicy:
    base: float = 1.0
    cap: float = 30.0
    restart_window: float = 10.0
    lost_window: float = 1.0
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0  # attempts in a row that did not register

    def delay(self, registered: bool, close_code: int | None) -> float:
        """Seconds to wait before the next attempt, after one that ``registered`` (or not) and was
        closed with ``close_code`` (None: no close frame came)."""
        if registered:
            self.failures = 0
            window = self.restart_window if close_code in _STOPPING else self.lost_window
            return self.rng.uniform(0, window)
        self.failures += 1
        return self.rng.uniform(0, min(self.cap, self.base * 2 ** min(self.failures - 1, 32)))
