"""Coordinator settings: every flag of CONTRACT §1 plus the periods tests may shorten."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from darkbloom.catalog import Catalog
from darkbloom.paths import darkbloom_home
from darkbloom.runtime import runtime_hash

TRUST_LEVELS = ("none", "self_signed", "hardware")


def default_database_url() -> str:
    return f"sqlite+aiosqlite:///{darkbloom_home() / 'coordinator.db'}"


@dataclass
class CoordinatorSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    database_url: str = field(default_factory=default_database_url)
    redis_url: str | None = None
    admin_token: str | None = None
    min_trust: str = "hardware"
    platform_fee_bps: int = 500
    queue_max_wait: float = 120.0
    queue_depth: int = 32
    catalog: Catalog = field(default_factory=Catalog.default)
    catalog_from_file: bool = False
    public_url: str | None = None
    # periods (seconds); configurable so that tests can shorten them
    heartbeat_timeout: float = 30.0
    eviction_interval: float = 1.0
    device_code_ttl: int = 900
    device_poll_interval: int = 5
    max_body_bytes: int = 8 * 1024 * 1024
    first_content_timeout: float = 30.0
    challenge_freshness: float = 960.0   # a session is routable while its last passed challenge is this recent
    challenge_interval: float = 300.0    # a new attestation challenge per session this often
    challenge_deadline: float = 30.0     # a challenge unanswered this long makes the session untrusted
    cancel_grace: float = 5.0            # wait this long for a cancelled provider's final usage
    instance_stale_after: float = 30.0   # an instance silent this long is dead: its reservations refunded
    # billing and account-level rate limits (per minute; None = unlimited)
    min_charge_micro_usd: int = 100
    account_rpm: int | None = None
    account_itpm: int | None = None
    account_otpm: int | None = None
    # trust (CONTRACT §7): runtime hashes accepted as verified (default: this release's own)
    runtime_allow_list: frozenset[str] = field(default_factory=lambda: frozenset({runtime_hash()}))
    enrollment_cert_days: float = 365.0  # validity of a hardware-trust certificate

    def __post_init__(self) -> None:
        if self.min_trust not in TRUST_LEVELS:
            raise ValueError(f"--min-trust must be one of {', '.join(TRUST_LEVELS)}")
        if not 0 <= self.platform_fee_bps <= 10_000:
            raise ValueError("--platform-fee-bps must be between 0 and 10000")
        for name in ("account_rpm", "account_itpm", "account_otpm"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1 (omit it for no limit)")
        if self.queue_max_wait < 0 or self.queue_depth < 0:
            raise ValueError("--queue-max-wait and --queue-depth must not be negative")
        for name in ("challenge_interval", "challenge_deadline", "challenge_freshness", "enrollment_cert_days"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        self.runtime_allow_list = frozenset(self.runtime_allow_list)

    @property
    def base_url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"

    @staticmethod
    def load_catalog(path: Path | None) -> Catalog:
        return Catalog.load(path) if path else Catalog.default()
