"""Who a request is from, once its token is known: the account, and the key, machine or console
session it came with (``http/auth.py`` makes one from the request's token)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from darkbloom.coordinator.identity.api_keys import ApiKey

CallerKind = Literal["api_key", "console_session", "device"]


@dataclass(frozen=True, slots=True)
class Caller:
    account_id: str
    kind: CallerKind
    key: ApiKey | None = None        # the API key when kind == "api_key"
    machine_id: str | None = None    # the machine when kind == "device"

    @property
    def key_id(self) -> str | None:
        return self.key.id if self.key else None
