"""When a node dials its coordinator again: a policy that spreads a whole fleet's reconnections.

A coordinator that restarts drops every node at once; if they all came back after the same delay
they would reach the new process together, its accept queue would overflow and most attempts would
time out (docs/protocol.md "Reconnecting"). So, from how the last connection ended:

- a registered session closed with 1012 "service restart" or 1001 "going away" (the coordinator is
  stopping, and so are all its sessions): the next attempt at a uniformly random moment of
  ``restart_window``;
- an attempt that did not register while that window lasts (the new process is not listening yet,
  or it turned the node away with 1013 "try again later"): another random moment of what is left
  of the window, so the fleet stays spread over it rather than piling up behind the slowest start;
- a registered session lost any other way (a dropped network, an eviction): within ``lost_window``;
- an attempt that did not register otherwise (refused, timed out, a broken handshake, closed before
  ``registered``, 1013): exponential backoff with full jitter, a uniform delay up to ``base`` ×
  2^(failures − 1), capped at ``cap``;
- a registration resets the backoff.

And when a connection is dead although nothing closed it (a network that went away, a laptop that
slept, a coordinator that hangs): the node pings the coordinator every ``PING_EVERY`` and drops a
connection whose pong has not come ``PING_TIMEOUT`` later (websockets' keepalive), so such a
connection is given up within 80 s. Each ping costs the coordinator a wake and a write per node,
which at 10,000 idle nodes was a third of its idle CPU with websockets' default of one every 20 s
(bench/RESULTS.md): hence a minute. (Not the kernel's ``TCP_USER_TIMEOUT``: it also aborts a
connection whose peer keeps its receive window shut that long, which the coordinator does on purpose
while a slow consumer catches up.)
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

GOING_AWAY = 1001
SERVICE_RESTART = 1012
TRY_AGAIN_LATER = 1013
_STOPPING = frozenset({GOING_AWAY, SERVICE_RESTART})
PING_EVERY = 60.0  # seconds
PING_TIMEOUT = 20.0
KEEPALIVE: dict[str, Any] = {"ping_interval": PING_EVERY, "ping_timeout": PING_TIMEOUT}  # for websockets' connect


@dataclass
class ReconnectPolicy:
    base: float = 1.0
    cap: float = 30.0
    restart_window: float = 10.0
    lost_window: float = 1.0
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.monotonic
    failures: int = 0  # attempts in a row that did not register (outside a restart's window)
    _window_ends: float = 0.0  # when the current restart's window closes (clock time)

    def delay(self, registered: bool, close_code: int | None) -> float:
        """Seconds to wait before the next attempt, after one that ``registered`` (or not) and was
        closed with ``close_code`` (None: no close frame came)."""
        now = self.clock()
        if registered:
            self.failures = 0
            if close_code in _STOPPING:
                self._window_ends = now + self.restart_window
                return self.rng.uniform(0, self.restart_window)
            self._window_ends = 0.0
            return self.rng.uniform(0, self.lost_window)
        left = self._window_ends - now
        if left >= self.base:  # expected while the coordinator restarts: stay spread over the window
            return self.rng.uniform(0, left)
        self.failures += 1
        return self.rng.uniform(0, min(self.cap, self.base * 2 ** min(self.failures - 1, 32)))
