"""The two interfaces around a session (``fleet/session.py``): the ``Link`` it reaches its node through
— the node's WebSocket on this replica (``fleet.connection.ProviderConnection``) or
the replica that holds it (``fabric.remote_link.RemoteLink``) — and the ``Inbox`` it delivers the
node's frames for one request to (``inference.attempts.Attempt``; on a holding replica,
``fabric.holder.Forwarder``).
"""

from __future__ import annotations

from typing import Protocol

from darkbloom.wire.protocol import Envelope, Usage


class Link(Protocol):
    """Everything that differs between a session on this replica's socket and one another replica
    holds; nothing above the link asks which one it has."""

    only_proven_chunks: bool  # every chunk it carries is sealed with the node's registered key

    @property
    def closing(self) -> bool:
        """Closing the node's socket was asked for here (that link takes no new work)."""

    def send(self, frame_json: str) -> None:
        """A frame for the node (never blocks, never interleaves with another)."""

    def send_request(self, request_id: str, ticket: str | None, frame_json: str) -> None:
        """The sealed ``inference_request`` of an attempt on the slot claimed under ``ticket``."""

    def cancel(self, request_id: str, ticket: str | None) -> None:
        """Tell the node to stop the request (it reports the usage so far)."""

    def claimed(self) -> str | None:
        """A slot was claimed: the ticket the session's holder knows the claim by (None here)."""

    async def confirm(self, ticket: str | None) -> bool:
        """Whether the slot claimed under ``ticket`` really is the session's."""

    def released(self, ticket: str | None) -> None:
        """The slot claimed under ``ticket`` was given back."""

    def report_speed(self, decode_tps: float) -> None:
        """This replica measured the session's decode speed."""

    def retire(self) -> None:
        """The machine was unlinked: the replica whose socket it is closes the session once idle."""

    def close(self, code: int = 1000) -> None:
        """Take the session out of routing here and close the node's socket once the frames queued
        before now are sent (another replica's session: nothing, its holder closes it)."""


class Inbox(Protocol):
    """Where a session delivers the node's frames for one request."""

    def on_chunk(self, envelope: Envelope) -> bool:
        """False when the chunk does not open (the session distrusts the provider)."""

    def on_complete(self, usage: Usage) -> bool:
        """False when the usage is impossible for the request (the session distrusts the provider)."""

    def on_error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        """The node failed the request."""

    def on_provider_gone(self) -> None:
        """The node went away before finishing the request."""

    def unread(self) -> int:
        """Chunks delivered and not yet relayed."""
