"""Sign-up and log-in throttles: failed log-ins per email and per client address (15 minutes),
sign-ups per client address (an hour). They are buckets of the coordinator's rate limiter, so with
``--redis-url`` every replica shares them; an attempt they refuse costs no password hash."""

from __future__ import annotations

import hashlib

from starlette.requests import HTTPConnection

from darkbloom.coordinator.money.ratelimit import Bucket, Charge, RateLimiterUnavailable
from darkbloom.coordinator.services import Services
from darkbloom.wire.openai.errors import ApiError

LOGIN_MINUTES = 15
SIGNUP_MINUTES = 60


def client_address(connection: HTTPConnection) -> str:
    """The socket peer, or the client a trusted proxy (DARKBLOOM_FORWARDED_ALLOW_IPS) forwarded:
    uvicorn puts that one in the scope."""
    return connection.client.host[:64] if connection.client else "unknown"


def _email_scope(email: str) -> str:
    return "login-email:" + hashlib.sha256(email.encode()).hexdigest()[:32]  # no email in Redis keys


def login_charges(services: Services, email: str, address: str) -> list[Charge]:
    """One attempt against the email's and the address's failed-log-in buckets."""
    settings = services.settings
    limits = ((_email_scope(email), settings.login_failures_per_email),
              (f"login-address:{address}", settings.login_failures_per_address))
    return [Charge(Bucket(scope, "attempts", limit, minutes=LOGIN_MINUTES), 1) for scope, limit in limits if limit]


def signup_charges(services: Services, address: str) -> list[Charge]:
    limit = services.settings.signups_per_address
    return [Charge(Bucket(f"signup-address:{address}", "attempts", limit, minutes=SIGNUP_MINUTES), 1)] if limit else []


async def take(services: Services, charges: list[Charge]) -> None:
    """Take every charge or none: 429 with Retry-After naming what is spent, 503 without the store."""
    if not charges:
        return
    try:
        decision = await services.rate_limiter.acquire(charges)
    except RateLimiterUnavailable:
        raise ApiError(503, "service_unavailable", "Log-in and sign-up are briefly unavailable; retry in a few "
                       "seconds.", headers={"Retry-After": "5"}) from None
    if decision.allowed:
        return
    assert decision.failed is not None
    scope = decision.failed.scope
    what = ("failed log-ins for this email" if scope.startswith("login-email:")
            else "failed log-ins from your address" if scope.startswith("login-address:")
            else "sign-ups from your address")
    wait = decision.retry_after_seconds
    raise ApiError(429, "rate_limit_exceeded", f"Too many {what}; retry after {wait} s.",
                   headers={"Retry-After": str(wait)})


async def give_back(services: Services, charges: list[Charge]) -> None:
    """A successful log-in is not a failure: its attempt goes back."""
    if charges:
        await services.rate_limiter.refund(charges)
