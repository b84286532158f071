"""Admission: rate limits (RPM before the body is parsed, ITPM/OTPM after) and the reservation.

Every refusal rolls back what was already taken, so a refused request costs nothing and leaves
no trace in the buckets or the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from darkbloom.catalog import CatalogModel
from darkbloom.coordinator import billing
from darkbloom.coordinator.auth import Caller
from darkbloom.coordinator.chat_request import ChatRequest
from darkbloom.coordinator.errors import ApiError
from darkbloom.coordinator.estimation import output_token_bound, prompt_token_bound
from darkbloom.coordinator.ratelimit import Bucket, Charge, Decision, Dimension, RateLimiterUnavailable
from darkbloom.coordinator.services import Services

_DIMENSION_NAMES = {"requests": "requests per minute", "input_tokens": "input tokens per minute",
                    "output_tokens": "output tokens per minute"}


@dataclass
class Admission:
    """What a request took at admission; settlement gives back what it did not use."""

    rate_charges: list[Charge] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    prompt_bound: int = 0
    output_bound: int = 0
    reservation: billing.Reservation | None = None


def _buckets(services: Services, caller: Caller, dimension: Dimension) -> list[Bucket]:
    settings = services.settings
    account_limit = {"requests": settings.account_rpm, "input_tokens": settings.account_itpm,
                     "output_tokens": settings.account_otpm}[dimension]
    key_field = {"requests": "rpm_limit", "input_tokens": "itpm_limit", "output_tokens": "otpm_limit"}[dimension]
    buckets = []
    if caller.key and caller.key.get(key_field):
        buckets.append(Bucket(f"key:{caller.key['id']}", dimension, int(caller.key[key_field])))
    if account_limit:
        buckets.append(Bucket(f"acct:{caller.account_id}", dimension, int(account_limit)))
    return buckets


async def _acquire(services: Services, charges: list[Charge]) -> Decision | None:
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
        advice = (f"This request alone needs {asked}; lower max_tokens or shorten the prompt, or raise the limit."
                  if asked > failed.limit_per_minute else f"Retry after {decision.retry_after_seconds} s.")
        raise ApiError(429, "rate_limit_exceeded",
                       f"Rate limit reached: your {scope} allows {failed.limit_per_minute} "
                       f"{_DIMENSION_NAMES[failed.dimension]}. {advice}",
                       param=decision.failed.dimension,
                       headers={"Retry-After": str(decision.retry_after_seconds), **decision.headers})
    return decision


async def admit_request_rate(services: Services, caller: Caller) -> Admission:
    """RPM, checked before the body is read."""
    admission = Admission()
    charges = [Charge(b, 1) for b in _buckets(services, caller, "requests")]
    decision = await _acquire(services, charges)
    if decision is not None:
        admission.rate_charges.extend(charges)
        admission.headers.update(decision.headers)
    return admission


async def admit(services: Services, caller: Caller, chat: ChatRequest, model: CatalogModel, request_id: str,
                admission: Admission, *, reserve: bool = True) -> Admission:
    """ITPM/OTPM with the estimates, then the reservation; on refusal undo everything taken."""
    admission.prompt_bound = prompt_token_bound(chat)
    admission.output_bound = output_token_bound(chat, model)
    charges = ([Charge(b, admission.prompt_bound) for b in _buckets(services, caller, "input_tokens")]
               + [Charge(b, admission.output_bound) for b in _buckets(services, caller, "output_tokens")])
    try:
        decision = await _acquire(services, charges)
        if decision is not None:
            admission.rate_charges.extend(charges)
            admission.headers.update(decision.headers)
        if reserve:
            amount = billing.worst_case(model, admission.prompt_bound, admission.output_bound,
                                        services.settings.min_charge_micro_usd)
            admission.reservation = await billing.reserve(services, request_id, caller.account_id, caller.key,
                                                          amount)
    except BaseException:
        await release_rates(services, admission)
        raise
    return admission


async def release_rates(services: Services, admission: Admission) -> None:
    """Give every rate charge back (the request was refused before it ran)."""
    if admission.rate_charges:
        await services.rate_limiter.refund(admission.rate_charges)
        admission.rate_charges = []


async def reconcile_rates(services: Services, admission: Admission, prompt_tokens: int,
                          completion_tokens: int) -> None:
    """Return the unused part of the token charges once the real counts are known."""
    unused = []
    for charge in admission.rate_charges:
        if charge.bucket.dimension == "input_tokens" and charge.amount > prompt_tokens:
            unused.append(Charge(charge.bucket, charge.amount - prompt_tokens))
        elif charge.bucket.dimension == "output_tokens" and charge.amount > completion_tokens:
            unused.append(Charge(charge.bucket, charge.amount - completion_tokens))
    if unused:
        await services.rate_limiter.refund(unused)
