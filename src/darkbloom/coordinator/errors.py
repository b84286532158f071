"""The named errors that more than one layer raises (fleet, identity, routing, the HTTP edge), kept below
all of them: each layer imports it without reaching up into another's module."""

from __future__ import annotations

from darkbloom.wire.openai.errors import ApiError


def machine_not_found() -> ApiError:
    """A machine id that is not one of the caller's linked machines (unknown, unlinked, or another's)."""
    return ApiError(404, "machine_not_found",
                    "No machine with this id is linked to your account. GET /v1/me/providers lists yours.")
