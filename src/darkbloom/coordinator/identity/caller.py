"""Who a request is from, once its token is known: the account, and the key, machine or console
session it came with (``http/auth.py`` makes one from the request's token)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

CallerKind = Literal["api_key", "console_session", "device"]


@dataclass(frozen=True)
class Caller:
    account_id: str
    kind: CallerKind
    key: dict[str, Any] | None = None  # the API key row when kind == "api_key"
    machine_id: str | None = None      # the machine when kind == "device"

    @property
    def key_id(self) -> str | None:
        return self.key["id"] if self.key else None
