"""Admission checks: rate limits (RPM before the body is read, ITPM/OTPM after, with the
estimates) and the reservation amount. The token charges a request took are kept — and given back —
by its ``RequestLifecycle``; its RPM charge is never given back. These functions only decide and raise
the named errors."""

from __future__ import annotations

from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.money.ratelimit import Bucket, Charge, Decision, Dimension, RateLimiterUnavailable
from darkbloom.coordinator.services import Services
from darkbloom.wire.openai.errors import ApiError

_DIMENSION_NAMES = {"requests": "requests per minute", "input_tokens": "input tokens per minute",
                    "output_tokens": "output tokens per minute"}


def _buckets(services: Services, caller: Caller, dimension: Dimension) -> list[Bucket]:
    settings = services.settings
    account_limit = {"requests": settings.account_rpm, "input_tokens": settings.account_itpm,
                     "output_tokens": settings.account_otpm}[dimension]
    key = caller.key
    key_limit = None if key is None else {"requests": key.rpm_limit, "input_tokens": key.itpm_limit,
                                          "output_tokens": key.otpm_limit}[dimension]
    buckets = []
    if key and key_limit:
        buckets.append(Bucket(f"key:{key.id}", dimension, key_limit))
    if account_limit:
        buckets.append(Bucket(f"acct:{caller.account_id}", dimension, int(account_limit)))
    return buckets


def request_charges(services: Services, caller: Caller) -> list[Charge]:
    """One request against every RPM bucket of the caller."""
    return [Charge(b, 1) for b in _buckets(services, caller, "requests")]


async def take_request(services: Services, caller: Caller) -> dict[str, str]:
    """The one place a request is taken from the caller's RPM buckets, on every inference route right
    after authentication and before the body is read; never given back, so a request refused later
    (400, 402, 404, a 429 on tokens) and a token count use one too. Returns the ``x-ratelimit-*``
    headers of the requests dimension (none without a limit); an empty bucket is the 429."""
    decision = await acquire(services, request_charges(services, caller))
    return decision.headers if decision is not None else {}


def token_charges(services: Services, caller: Caller, prompt_bound: int, output_bound: int) -> list[Charge]:
    """The estimated tokens against every ITPM and OTPM bucket of the caller."""
    return ([Charge(b, prompt_bound) for b in _buckets(services, caller, "input_tokens")]
            + [Charge(b, output_bound) for b in _buckets(services, caller, "output_tokens")])


async def acquire(services: Services, charges: list[Charge]) -> Decision | None:
    """Take every charge or none; a refusal is a 429 naming the bucket (nothing was taken)."""
    if not charges:
        return None
    try:
        decision = await services.rate_limiter.acquire(charges)
    except RateLimiterUnavailable:
        raise ApiError(503, "service_unavailable",
                       "Rate limiting is temporarily unavailable; retry in a few seconds.",
                       headers={"Retry-After": "5"}) from None
    if not decision.allowed:
        failed = decision.failed
        assert failed is not None
        scope = "API key" if failed.scope.startswith("key:") else "account"
        asked = max(c.amount for c in charges if c.bucket == failed)
        hopeless = asked > failed.limit_per_minute  # larger than the whole bucket: no wait will admit it
        advice = (f"This request alone needs {asked}; lower max_tokens or shorten the prompt, or raise the limit."
                  if hopeless else f"Retry after {decision.retry_after_seconds} s.")
        retry = {"x-should-retry": "false"} if hopeless else {"Retry-After": str(decision.retry_after_seconds)}
        raise ApiError(429, "rate_limit_exceeded",
                       f"Rate limit reached: your {scope} allows {failed.limit_per_minute} "
                       f"{_DIMENSION_NAMES[failed.dimension]}. {advice}",
                       param=failed.dimension, headers={**retry, **decision.headers})
    return decision


def unused_token_charges(charges: list[Charge], prompt_tokens: int, completion_tokens: int) -> list[Charge]:
    """The part of the token charges the request did not use, once the real counts are known
    (request charges are never unused: an admitted request counts against RPM)."""
    unused = []
    for charge in charges:
        if charge.bucket.dimension == "input_tokens" and charge.amount > prompt_tokens:
            unused.append(Charge(charge.bucket, charge.amount - prompt_tokens))
        elif charge.bucket.dimension == "output_tokens" and charge.amount > completion_tokens:
            unused.append(Charge(charge.bucket, charge.amount - completion_tokens))
    return unused
