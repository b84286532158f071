"""Coordinator settings: every flag of `darkbloom coordinator` (docs/cli.md "Coordinator flags") plus the
periods tests may shorten.

This is the one place their defaults and help live; `darkbloom coordinator` builds its options from
it. A setting not given as a keyword is read from ``DARKBLOOM_<FLAG_NAME>``, else its default.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from darkbloom.paths import darkbloom_home
from darkbloom.wire.catalog import Catalog
from darkbloom.wire.runtime import runtime_hash

TRUST_LEVELS = ("none", "self_signed", "hardware")
_SUBJECT_PREFIX = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
ENV_PREFIX = "DARKBLOOM_"


def default_database_url() -> str:
    return f"sqlite+aiosqlite:///{darkbloom_home() / 'coordinator.db'}"


class CoordinatorSettings(BaseSettings):
    # A field whose flag differs from its name carries the flag's env var as its alias.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, populate_by_name=True,
                                      loc_by_alias=False)

    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8080, description="Port to bind.")
    database_url: str = Field(
        default_factory=default_database_url,
        description="SQLAlchemy URL; default sqlite+aiosqlite:///$DARKBLOOM_HOME/coordinator.db; "
                    "postgresql+asyncpg://… selects Postgres.")
    redis_url: str | None = Field(
        None, description="Redis for rate limits shared across replicas (default: in memory).")
    nats_url: str | None = Field(
        None, description="NATS server joining replicas into one fleet (nats://host:4222): replicas with the "
                          "same database, Redis and NATS serve any machine connected to any of them "
                          "(default: none, this process serves only its own connections).")
    nats_creds: Path | None = Field(
        None, description="NATS credentials file (.creds: the user's JWT and nkey seed) for --nats-url.")
    nats_nkey: Path | None = Field(None, description="NATS nkey seed file (SU…) for --nats-url.")
    nats_tls_ca: Path | None = Field(
        None, description="CA certificate(s) (PEM) the NATS server's certificate must chain to "
                          "(default: the system's).")
    nats_tls_cert: Path | None = Field(
        None, description="Client certificate (PEM) presented to NATS; needs --nats-tls-key.")
    nats_tls_key: Path | None = Field(None, description="Private key (PEM) of --nats-tls-cert.")
    nats_subject_prefix: str = Field(
        "darkbloom", description="First tokens of every NATS subject; the replicas of one coordinator share it, "
                                 "another coordinator on the same NATS server uses its own.")
    replica_heartbeat: float = Field(
        1.0, description="Seconds between this replica's announcements of its sessions over NATS.")
    replica_timeout: float = Field(
        3.0, description="A replica silent this many seconds is gone: its sessions leave the other replicas' "
                         "view and the requests it sent elsewhere are cancelled.")
    cors_origins: str | None = Field(
        None, description="Browser origins allowed to call the API, comma-separated ('*' for any; default none).")
    admin_token: str | None = Field(
        None, description="Bearer token for /v1/admin/*; admin API disabled when unset.")
    min_trust: str = Field(
        "hardware",
        description="Trust floor for public routing: none|self_signed|hardware (relaxed only for your own machines).")
    platform_fee_bps: int = Field(500, description="Platform fee in basis points of each paid request's cost.")
    queue_max_wait: float = Field(120.0, description="Seconds a request may wait in a busy model's queue.")
    queue_depth: int = Field(32, description="Waiting requests per model queue.")
    # a path (the --catalog flag) is loaded into the live catalog and sets catalog_from_file
    catalog: Annotated[Catalog, NoDecode] = Field(
        default_factory=Catalog.default, description="Model catalog file (JSON or TOML).")
    catalog_from_file: bool = False
    public_url: str | None = Field(None, description="Base URL users reach (default: http://host:port).")
    smtp_url: str | None = Field(
        None, description="Mail server for email-address verification codes: smtp://[user:password@]host[:port] "
                          "(STARTTLS when the server offers it) or smtps://… (TLS from the start); default none: "
                          "shares are then accepted with their invite codes only.")
    mail_from: str = Field("darkbloom@localhost", description="Sender address of the coordinator's mail.")

    # periods (seconds); configurable so that tests can shorten them
    heartbeat_timeout: float = Field(30.0, description="Evict a provider silent this many seconds.")
    eviction_interval: float = 1.0
    machine_flush_interval: float = Field(
        1.0, description="Seconds between the batched writes of the machines' last seen, models and trust "
                         "(one transaction for every machine whose session changed or heartbeated).")
    insight_interval: float = Field(
        10.0, description="Seconds between the batched writes of machine insight (why machines were passed over, "
                          "their busy slots and decode speed), which is also how often the sessions are sampled.")
    device_code_ttl: int = Field(900, description="Lifetime of a device login code in seconds.")
    device_poll_interval: int = 5
    email_code_ttl: int = 900          # seconds an email verification code stays valid
    email_code_interval: int = 60      # seconds between two codes sent to one account
    max_body_bytes: int = 8 * 1024 * 1024
    first_content_timeout: float = Field(30.0, description="Seconds a provider may take to its first content.")
    idle_timeout: float = Field(
        60.0, description="Seconds a provider may stay silent between chunks once content has started.")
    request_timeout: float = Field(
        600.0, description="Seconds a request may take from dispatch to its last chunk, whatever the provider sends.")
    challenge_freshness: float = Field(
        960.0, description="A provider is routable while its last passed challenge is at most this many seconds old.")
    challenge_interval: float = Field(300.0, description="Seconds between attestation challenges to each provider.")
    challenge_deadline: float = Field(
        30.0, description="Seconds a provider has to answer a challenge before it is untrusted.")
    cancel_grace: float = Field(5.0, description="Seconds to wait for a cancelled provider's usage report.")
    instance_stale_after: float = Field(
        30.0, description="A coordinator instance silent this long is dead; its open reservations are refunded.")

    # billing and account-level rate limits (per minute; None = unlimited)
    min_charge_micro_usd: int = Field(100, validation_alias="darkbloom_min_charge",
                                      description="Minimum charge of a paid request, µUSD.")
    account_rpm: int | None = Field(
        None, description="Default requests per minute per account (unset: no limit).")
    account_itpm: int | None = Field(None, description="Default input tokens per minute per account.")
    account_otpm: int | None = Field(None, description="Default output tokens per minute per account.")

    # batches (docs/batches.md)
    batch_discount: float = Field(
        0.5, description="What a batch line run on the fleet pays, as a fraction of the live price (before the "
                         "minimum charge); own and shared machines are priced as live.")
    batch_free_slots: int = Field(
        1, description="Slots of each machine a batch line leaves free for live requests (a machine with fewer "
                       "slots than this plus one still runs batch lines, one at a time).")
    batch_max_file_bytes: int = 100 * 1024 * 1024  # an uploaded file's size limit
    batch_max_lines: int = 50_000                   # a batch input file's line limit
    batch_lines_in_flight: int = 16   # a batch's lines one coordinator runs at once (each waits for its slot)
    batch_lease_seconds: float = 60.0  # a running line is this instance's for so long, renewed while it runs
    batch_poll_interval: float = 1.0   # seconds between looks for batches with lines to run or to finish
    batch_retry_seconds: float = 10.0  # a line with no machine to run on (offline, busy, unlinked) waits so long

    # sign-up and log-in throttles (docs/api.md); 0 turns one off
    login_failures_per_email: int = 10     # failed log-ins per email in 15 minutes
    login_failures_per_address: int = 100  # failed log-ins per client address in 15 minutes
    signups_per_address: int = 20          # sign-ups per client address in an hour
    forwarded_allow_ips: str = "127.0.0.1,::1"  # proxies whose X-Forwarded-For names the client
    # argon2id cost of new password hashes (each hash keeps its own, so lowering it weakens new ones
    # only); the default is argon2-cffi's recommended one, the floor OWASP's minimum (19 MiB, 2 passes)
    password_hash_memory_kib: int = 65_536
    password_hash_time_cost: int = 3

    # trust (docs/protocol.md "Registration and trust"): runtime hashes accepted as verified (default: this
    # release's own)
    runtime_allow_list: frozenset[str] = Field(default_factory=lambda: frozenset({runtime_hash()}))
    runtime_allow: Annotated[tuple[str, ...], NoDecode] = Field(
        default_factory=tuple,
        description="A provider runtime hash to accept as verified, besides this release's own; may repeat.")
    enrollment_cert_days: float = 365.0  # validity of a hardware-trust certificate

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ValueError(_one_line(exc)) from None

    @model_validator(mode="before")
    @classmethod
    def _read_flag_values(cls, data: Any) -> Any:
        """A catalog path (--catalog or its env var) becomes the loaded catalog; DARKBLOOM_RUNTIME_ALLOW
        holds hashes separated by spaces, as the repeated flag would."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("catalog"), (str, Path)):
            data["catalog"], data["catalog_from_file"] = _load_catalog(Path(data["catalog"])), True
        if isinstance(data.get("runtime_allow"), str):
            data["runtime_allow"] = data["runtime_allow"].split()
        return data

    @model_validator(mode="after")
    def _check(self) -> CoordinatorSettings:
        if self.min_trust not in TRUST_LEVELS:
            raise ValueError(f"--min-trust must be one of {', '.join(TRUST_LEVELS)}")
        if not 0 <= self.platform_fee_bps <= 10_000:
            raise ValueError("--platform-fee-bps must be between 0 and 10000")
        for name in ("account_rpm", "account_itpm", "account_otpm"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{flag_name(name)} must be at least 1 (omit it for no limit)")
        for name in ("login_failures_per_email", "login_failures_per_address", "signups_per_address"):
            if getattr(self, name) < 0:
                raise ValueError(f"{env_var(name)} must not be negative (0 turns the limit off)")
        if self.password_hash_memory_kib < 19_456 or self.password_hash_time_cost < 2:
            raise ValueError(f"{env_var('password_hash_memory_kib')} must be at least 19456 and "
                             f"{env_var('password_hash_time_cost')} at least 2 (OWASP's minimum for argon2id)")
        if not 0 < self.batch_discount <= 1:
            raise ValueError("--batch-discount must be above 0 and at most 1")
        if self.batch_free_slots < 0 or self.batch_lines_in_flight < 1:
            raise ValueError("--batch-free-slots must not be negative and DARKBLOOM_BATCH_LINES_IN_FLIGHT must be "
                             "at least 1")
        if self.queue_max_wait < 0 or self.queue_depth < 0:
            raise ValueError("--queue-max-wait and --queue-depth must not be negative")
        for name in ("challenge_interval", "challenge_deadline", "challenge_freshness", "enrollment_cert_days",
                     "first_content_timeout", "idle_timeout", "request_timeout", "replica_heartbeat",
                     "machine_flush_interval", "insight_interval", "batch_lease_seconds", "batch_poll_interval",
                     "batch_retry_seconds", "batch_max_file_bytes", "batch_max_lines"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{flag_name(name)} must be positive")
        if self.replica_timeout <= self.replica_heartbeat:
            raise ValueError("--replica-timeout must be longer than --replica-heartbeat")
        _check_nats_files(self)
        if self.smtp_url is not None and urlsplit(self.smtp_url).scheme not in ("smtp", "smtps"):
            raise ValueError("--smtp-url must start with smtp:// or smtps://")
        if not _SUBJECT_PREFIX.fullmatch(self.nats_subject_prefix):
            raise ValueError("--nats-subject-prefix must be dot-separated tokens of letters, digits, '_' and '-'")
        self.runtime_allow_list = self.runtime_allow_list | frozenset(self.runtime_allow)
        return self

    @property
    def base_url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"


def flag_name(field: str) -> str:
    """The command-line flag of a setting: its alias (an env var name) without the prefix, else its name."""
    alias = CoordinatorSettings.model_fields[field].validation_alias
    name = alias.removeprefix(ENV_PREFIX.lower()) if isinstance(alias, str) else field
    return "--" + name.replace("_", "-")


def env_var(field: str) -> str:
    return ENV_PREFIX + flag_name(field).removeprefix("--").replace("-", "_").upper()


_NATS_FILES = ("nats_creds", "nats_nkey", "nats_tls_ca", "nats_tls_cert", "nats_tls_key")


def _check_nats_files(settings: CoordinatorSettings) -> None:
    given = [name for name in _NATS_FILES if getattr(settings, name) is not None]
    if given and settings.nats_url is None:
        raise ValueError(f"{flag_name(given[0])} needs --nats-url")
    if settings.nats_creds is not None and settings.nats_nkey is not None:
        raise ValueError("give --nats-creds or --nats-nkey, not both (a .creds file holds its own nkey seed)")
    if (settings.nats_tls_cert is None) != (settings.nats_tls_key is None):
        raise ValueError("--nats-tls-cert and --nats-tls-key go together: give both or neither")
    for name in given:
        path = getattr(settings, name)
        if not path.is_file():
            raise ValueError(f"{flag_name(name)}: {'not a file' if path.exists() else 'no such file'}: {path}")


def _load_catalog(path: Path) -> Catalog:
    try:
        return Catalog.load(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--catalog: cannot load {path}: {' '.join(str(exc).split())}") from None


def _one_line(exc: ValidationError) -> str:
    """Our own checks keep their sentence; a value of the wrong type names its flag and env var."""
    messages = []
    for error in exc.errors():
        if error["type"] == "value_error":
            messages.append(str(error["ctx"]["error"]))
        elif error["loc"] and str(error["loc"][0]) in CoordinatorSettings.model_fields:
            field = str(error["loc"][0])
            messages.append(f"{flag_name(field)} (or {env_var(field)}): {error['msg']}")
        else:
            messages.append(error["msg"])
    return "; ".join(messages)
