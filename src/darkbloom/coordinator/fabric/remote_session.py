"""Another replica's session, listed in this replica's registry as a stand-in.

It carries the announced facts the gates, the scheduler, the owned views and the Self-Route
pre-flight read, so all of them see the whole fleet through the one registry. What it is asked to
do goes to the replica holding the real session (``holder``): a slot claimed on it gets a ticket,
``confirm`` claims it there, ``send_request`` hands it the sealed frame, ``send`` passes other
frames (cancel, trust status), a release or a new measured speed is reported, ``unlinked`` asks the
holder to retire its session. Its ``_active`` count is the holder's, as last announced.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from darkbloom.coordinator.fleet.session import ProviderSession

if TYPE_CHECKING:
    from darkbloom.coordinator.fabric.outbound import Outbound
    from darkbloom.coordinator.fleet.pending import PendingRequest
    from darkbloom.coordinator.fleet.slots import Slot


@dataclass(eq=False)
class RemoteSession(ProviderSession):
    holder: str = ""                                    # the replica (instance id) holding the session
    outbound: "Outbound | None" = field(default=None, repr=False)
    syncing: bool = field(default=False, repr=False)    # applying the holder's announcement: nothing to report

    remote: ClassVar[bool] = True

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "decode_tps" and self.__dict__.get("syncing") is False:
            outbound = self.__dict__.get("outbound")
            if outbound is not None:
                outbound.speed(self, value)  # measured here, at settlement: the holder keeps it for everyone

    def claimed(self, slot: "Slot") -> None:
        slot.ticket = secrets.token_hex(8)

    def released(self, slot: "Slot") -> None:
        if self.outbound is not None:
            self.outbound.released(self, slot)

    async def confirm(self, slot: "Slot") -> bool:
        return self.outbound is not None and await self.outbound.confirm(self, slot)

    def send_request(self, pending: "PendingRequest", frame_json: str) -> None:
        if self.outbound is None:
            pending.on_provider_gone()
        else:
            self.outbound.send_request(self, pending, frame_json)

    def send(self, frame_json: str) -> None:
        if self.outbound is not None:
            self.outbound.send_frame(self, frame_json)

    def close(self, code: int = 1000) -> None:
        """Not this replica's socket: the holder closes it."""

    def unlinked(self) -> None:
        if self.outbound is not None:
            self.outbound.unlinked(self)
