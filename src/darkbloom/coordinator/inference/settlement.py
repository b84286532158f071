"""A request's settlement: everything it takes is recorded on its ``RequestLifecycle`` as it is
taken, and this is the one place that gives back what it did not use and settles what it did.

A request takes, in order: its RPM charge (``take_request``, before the body; never given back, so
not recorded), token charges (ITPM/OTPM) and a reservation as its route needs them (``admit``: paid
and prefer requests, and shared ones that may use a priced share), provider slots (the first
placement, retries, a backup) and, when placed on a shared machine, a share's daily allowance. The
``RequestLifecycle`` records each as it is taken and, when the request ends, gives back exactly what
was not used — once, on every end:

- refused before admission completed (bad body, unknown model, 429, 402): the token charges back;
- admitted but never served (no provider, queue refused, every attempt failed, client gone or
  task cancelled before first content): every slot and the reservation back, the token charges
  back;
- served: the winning attempt settles (charge on success; refund when the provider failed after
  first content), token charges reconciled with the real counts; a vanished client or a cancel
  stops the provider and charges what it reported (``charge_partial``).

A batch line's lifecycle (``batch``) takes no rate charges (its batch was one request), reserves at
the batch price on the fleet, and, stopped before its end (its coordinator stopping, its batch
cancelled before it was placed), charges nothing — the line runs again or ends uncharged.

Use it as ``async with RequestLifecycle(...) as life:``. A served answer settles with ``finish``
before its usage is shown — the non-streamed body (and its ``X-Darkbloom-Cost-Micro-USD``) is built
after it, a stream's last events follow it — so the ``cost_micro_usd`` the caller reads is what the
settlement charged, the figure of the usage row; the request's log line (``write_log``) follows the
answer. A streamed answer also takes the end over with ``hand_off()``: the response tells the
lifecycle its end (``answer_ended``), which ends a stream that stopped early (the client went away)
with a partial charge.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

from prometheus_client import Histogram

from darkbloom.coordinator.fleet.slots import Slot
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.inference.attempts import Attempt
from darkbloom.coordinator.inference.calls import TokenBounds
from darkbloom.coordinator.inference.disconnect import ClientDisconnected
from darkbloom.coordinator.money import admission, billing
from darkbloom.coordinator.money.ratelimit import Charge
from darkbloom.coordinator.routing.decision import Policy, RouteDecision, ShareGrant
from darkbloom.coordinator.routing.sharing import take_allowance
from darkbloom.coordinator.services import Services
from darkbloom.store import shares
from darkbloom.wire.catalog import CatalogModel
from darkbloom.wire.openai.errors import ApiError

T = TypeVar("T")
log = logging.getLogger("darkbloom.completions")
SETTLE_ATTEMPTS = 4
DECODE_SPEED_WEIGHT = 0.2
_GONE = (asyncio.CancelledError, ClientDisconnected, GeneratorExit)
REQUEST_SECONDS = Histogram(
    "darkbloom_request_duration_seconds",
    "Inference requests from the coordinator taking them up to their end (the answer or the stream's last "
    "event, its settlement included), by API path and outcome: ok, refused (before admission), unserved "
    "(admitted, never served), failed (after first content), client_disconnected",
    ["api", "outcome"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))


class RequestLifecycle:
    def __init__(self, services: Services, caller: Caller, request_id: str, api: str,
                 batch: billing.BatchTerms | None = None) -> None:
        self.services = services
        self.caller = caller
        self.request_id = request_id
        self.api = api  # the API's path: a metric label
        # a batch line: no rate limits (its batch was one request), the batch price on the fleet, and a line
        # stopped before its end (its coordinator stopping, the batch expiring) charges nothing: it runs again
        self.batch = batch
        self.started = time.monotonic()
        self.rate_charges: list[Charge] = []
        self.rate_headers: dict[str, str] = {}
        self.reservation: billing.Reservation | None = None
        self.admitted = False
        self.policy: Policy | None = None  # as admitted
        self.model: CatalogModel | None = None
        self.self_routed = False
        self.exclusive = False
        self.bounds: TokenBounds | None = None  # the most a provider may report
        self.serving: Attempt | None = None  # the attempt whose content goes to the client
        self.share: ShareGrant | None = None  # the share whose allowance it took, and on which UTC day
        self.cost_micro_usd = 0  # what its settlement charged the caller (the usage row's cost_micro_usd)
        self._share_day = 0
        self._slots: list[Slot] = []
        self._attempts: list[Attempt] = []
        self._handed_off = False
        self._ended = False
        self._log_outcome: str | None = None  # settled, its line not yet written
        services.requests_in_flight += 1  # until it is observed as ended (_observe: once, however it ends)

    # taking

    async def take_request(self) -> None:
        """The request against the caller's RPM buckets, before its body is read; never given back."""
        self.rate_headers.update(await admission.take_request(self.services, self.caller))

    async def charge_rates(self, charges: list[Charge]) -> None:
        """Take every token charge or raise the 429 (then nothing more was taken)."""
        decision = await admission.acquire(self.services, charges)
        if decision is not None:
            self.rate_charges.extend(charges)
            self.rate_headers.update(decision.headers)

    async def admit(self, policy: Policy, decision: RouteDecision, bounds: TokenBounds) -> Policy:
        """Token charges and the reservation the route needs: none for exclusive self-route (no key spend
        cap either; rate limits still apply), the worst case at the dearest priced share for shared
        routing — and when the balance cannot hold that but the caller's own machines or a free share
        could serve, no reservation and only those (docs/sharing.md "Money"). A prefer request whose key's
        fallback budget cannot hold its worst case goes on as exclusive (docs/self-route.md "Fallback
        budget"): the policy it is placed with is returned."""
        model = decision.model
        if not policy.shared:
            prefer = policy.mode == "prefer"
            await self._reserve(model, bounds, self_routed=policy.self_routed, reserve=not policy.exclusive,
                                prefer=prefer)
            if prefer and self.exclusive:
                decision.owned_only = True
                policy = dataclasses.replace(policy, mode="exclusive")
            self.policy = policy
            return policy
        min_charge = self.services.settings.min_charge_micro_usd
        priced = [grant.priced_model(model) for grant in decision.shares if grant.priced]
        dearest = max(priced, key=lambda m: billing.worst_case(m, bounds.prompt, bounds.output, min_charge),
                      default=None)
        owned = self.services.registry.owned_by(self.caller.account_id)
        free_route = (any(not grant.priced for grant in decision.shares)
                      or any(name in s.advertised_models for s in owned for name in decision.names))
        await self._reserve(model, bounds, self_routed=True, reserve=dearest is not None, reserve_at=dearest,
                            unreserved_if_short=free_route)
        if dearest is not None and self.reservation is None:
            decision.shares = tuple(grant for grant in decision.shares if not grant.priced)
        self.policy = policy
        return policy

    async def _reserve(self, model: CatalogModel, bounds: TokenBounds, *, self_routed: bool, reserve: bool,
                       reserve_at: CatalogModel | None = None, unreserved_if_short: bool = False,
                       prefer: bool = False) -> None:
        """ITPM/OTPM with the estimates, then the worst-case reservation (402 when it cannot be held), at
        the model's prices or ``reserve_at``'s (a priced share's). With ``unreserved_if_short``, a
        balance that cannot hold it admits the request without one (it then goes only where it is free).
        A ``prefer`` request also holds it against the key's fallback budget; when that cannot, it is
        admitted without a reservation, as exclusive (``self.exclusive``: own machines only, $0)."""
        self.model, self.self_routed, self.bounds = model, self_routed, bounds
        if self.batch is None:
            await self.charge_rates(admission.token_charges(self.services, self.caller, bounds.prompt, bounds.output))
        if reserve:
            price_bps = self.batch.fleet_price_bps if self.batch is not None and reserve_at is None \
                else billing.FULL_PRICE_BPS
            amount = billing.worst_case(reserve_at or model, bounds.prompt, bounds.output,
                                        self.services.settings.min_charge_micro_usd, price_bps)
            try:
                self.reservation = await billing.reserve(self.services, self.request_id, self.caller.account_id,
                                                         self.caller.key, amount, prefer=prefer)
            except billing.FallbackExhausted:
                pass
            except ApiError as exc:
                if not (unreserved_if_short and exc.status == 402):
                    raise
        # exclusive self-route (and shared routing without a priced share): never reserves, never charged
        self.exclusive = self_routed and self.reservation is None
        self.admitted = True

    async def take_share(self, grant: ShareGrant) -> bool:
        """One request and its worst-case tokens against the share's daily limits (False: a limit would
        be passed, nothing taken); given back unless the request is served through it."""
        assert self.share is None and self.bounds is not None
        day = await take_allowance(self.services, grant, self.bounds.prompt + self.bounds.output)
        if day is None:
            return False
        self.share, self._share_day = grant, day
        return True

    def hold(self, slot: Slot) -> None:
        """A claimed slot is the lifecycle's until an attempt is dispatched on it (or the end)."""
        self._slots.append(slot)

    def track(self, attempt: Attempt) -> None:
        """A dispatched attempt: cancelled and released at the end unless it is the one serving."""
        self._attempts.append(attempt)

    def serve_with(self, attempt: Attempt) -> None:
        self.serving = attempt

    def hand_off(self) -> None:
        """The response stream ends this request from now on (the handler's ``async with`` exits early)."""
        self._handed_off = True

    def answer_headers(self) -> dict[str, str]:
        """What the answer says of the request: its id, the serving session, how it was routed and
        billed, and the rate limits that applied."""
        assert self.serving is not None and self.policy is not None
        session, policy, share = self.serving.session, self.policy, self.share
        owned = session.account_id == self.caller.account_id
        shared = not owned and share is not None
        priced_share = share is not None and share.priced
        free = (owned and policy.self_routed) or policy.exclusive or (shared and not priced_share)
        return {"X-Request-Id": self.request_id, "X-Provider-Id": session.id,
                "X-Darkbloom-Routed": "owned" if owned else "shared" if shared else "fleet",
                "X-Darkbloom-Billing": "free" if free else "charged", **self.rate_headers}

    # ending

    async def __aenter__(self) -> "RequestLifecycle":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        _tb: Any) -> None:
        if self._ended or (exc is None and self._handed_off):
            if exc is not None:
                self.write_log()  # finished, but no answer will go to write it after
            return
        gone = isinstance(exc, _GONE)
        if self.serving is None:
            end = self._give_back()
            outcome = "client_disconnected" if gone else "unserved" if self.admitted else "refused"
        elif exc is None:
            end, outcome = self._settle("ok", charge_partial=False), "ok"
        elif gone and self.batch is not None:
            end, outcome = self._settle("stopped", charge_partial=False, stop=True), "client_disconnected"
        elif gone:
            end, outcome = self._settle("client_disconnected", charge_partial=True), "client_disconnected"
        else:
            failure = self.serving.failure
            end, outcome = self._settle(failure.reason if failure else "error", charge_partial=False), "failed"
        self._ended = True
        task = self.services.spawn(end)
        try:
            if not gone:
                await asyncio.shield(task)  # the answer waits for its bookkeeping; a vanished client cannot cut it
        finally:
            self._observe(outcome)

    async def finish(self, outcome: str) -> int:
        """End a served request now, before the answer shows its usage, shielded from the client (it
        settles once whatever happens to the caller's task); returns what the settlement charged, in
        µUSD (0: free, or nothing was charged)."""
        if self._ended:
            return self.cost_micro_usd
        self._ended = True
        try:
            await asyncio.shield(self.services.spawn(self._settle(outcome, charge_partial=False, log_now=False)))
        finally:
            self._observe("ok" if outcome == "ok" else "failed")
        return self.cost_micro_usd

    def write_log(self) -> None:
        """The request's line, once its answer has gone (``finish`` leaves it for then: formatting it
        need not stand between the settlement and the answer's bytes)."""
        outcome, self._log_outcome = self._log_outcome, None
        if outcome is not None:
            self._log(outcome)

    def answer_ended(self) -> None:
        """The handed-off answer ended: a stream that ended without ``finish`` lost its client."""
        if not self._ended:
            self._ended = True
            self.services.spawn(self._settle("client_disconnected", charge_partial=True))
            self._observe("client_disconnected")

    def _observe(self, outcome: str) -> None:
        self.services.requests_in_flight -= 1
        REQUEST_SECONDS.labels(self.api, outcome).observe(time.monotonic() - self.started)

    def _release_attempts(self, keep: Attempt | None = None) -> None:
        for attempt in self._attempts:
            if attempt is not keep:
                attempt.abandon()
        for slot in self._slots:
            slot.release()  # a no-op for the slots an attempt already released

    async def _give_back(self) -> None:
        self._release_attempts()
        await self._close_share(None)
        reservation = self.reservation
        if reservation is not None:
            await self._money("refund", lambda: billing.refund(self.services, reservation))
        charges = admission.unused_token_charges(self.rate_charges, 0, 0)
        if charges:
            await self.services.rate_limiter.refund(charges)

    async def _settle(self, outcome: str, *, charge_partial: bool, log_now: bool = True, stop: bool = False) -> None:
        """Charge what the serving attempt used (``outcome`` "ok", or ``charge_partial``: stopped first, what
        it reported) or give the reservation back (``stop``: the attempt stopped first, nothing charged)."""
        services, attempt = self.services, self.serving
        assert attempt is not None and self.model is not None
        if charge_partial:
            await attempt.stop(services.settings.cancel_grace)
        elif stop:
            attempt.abandon()
        attempt.release()
        self._release_attempts(keep=attempt)
        _measure_decode_speed(attempt)
        usage = attempt.usage if (outcome == "ok" or charge_partial) else None
        session = attempt.session
        # the owner is re-read from the serving session object, even if it has disconnected since
        served = billing.Served(provider_id=session.id, provider_account_id=session.account_id,
                                machine_id=session.machine_id)
        through_share = self.share is not None and session.account_id != self.caller.account_id
        terms = billing.ShareTerms(self.share.id, self.share.owner_account_id, self.share.priced_model(self.model)
                                   ) if self.share is not None and through_share else None
        bill = billing.Bill(self.request_id, self.caller.account_id, self.caller.key_id, self.model,
                            self.reservation, self.self_routed, exclusive=self.exclusive, share=terms,
                            batch=self.batch)
        await self._close_share(usage if through_share else None)
        reservation = self.reservation
        if usage is not None:
            settled = await self._money("settlement", lambda: billing.settle_bill(services, bill, usage, served))
            if settled is not None:
                self.cost_micro_usd = settled.cost
            else:  # a retry found it settled (a commit whose reply was lost), or it never was: its row says
                charged = await self._money("cost read", lambda: billing.charged(services, self.request_id))
                self.cost_micro_usd = charged or 0
        elif reservation is not None:
            await self._money("refund", lambda: billing.refund(services, reservation))
        unused = admission.unused_token_charges(self.rate_charges, usage.prompt_tokens if usage else 0,
                                                usage.completion_tokens if usage else 0)
        if unused:
            await services.rate_limiter.refund(unused)
        self._log_outcome = (outcome if usage is not None or outcome != "client_disconnected"
                             else "client_disconnected_unbilled")
        if log_now:
            self.write_log()

    async def _close_share(self, usage: Any) -> None:
        """The share's allowance: what the request used when it was served through it, else all back."""
        grant, self.share = self.share, None
        if grant is None:
            return
        assert self.bounds is not None
        held = self.bounds.prompt + self.bounds.output
        try:
            async with self.services.engine.begin() as conn:
                if usage is not None:
                    await shares.settle(conn, grant.id, self._share_day, held,
                                        usage.prompt_tokens + usage.completion_tokens)
                else:
                    await shares.give_back(conn, grant.id, self._share_day, held)
        except Exception:  # noqa: BLE001 - a day's counter; the request's money is settled apart
            log.exception("request %s: share %s allowance could not be closed", self.request_id, grant.id)

    async def _money(self, what: str, step: Callable[[], Awaitable[T]]) -> T | None:
        """A settlement or refund through the ledger writer, which retries a failed batch itself; this
        retries a step that still failed (idempotent on the request id), then leaves the reservation to
        the reconciler of the next start (and returns None). Awaited: the answer's last byte follows
        its commit."""
        for attempt in range(1, SETTLE_ATTEMPTS + 1):
            try:
                return await step()
            except Exception:  # noqa: BLE001 - retried, then left to the reconciler at the next restart
                log.exception("request %s: %s attempt %d failed", self.request_id, what, attempt)
                if attempt < SETTLE_ATTEMPTS:
                    await asyncio.sleep(0.2 * 2 ** attempt)
        return None

    def _log(self, outcome: str) -> None:
        assert self.serving is not None and self.model is not None
        usage = self.serving.usage
        log.info("request_id=%s account=%s key=%s model=%s provider=%s outcome=%s prompt_tokens=%s "
                 "completion_tokens=%s cached_tokens=%s ms=%d", self.request_id, self.caller.account_id,
                 self.caller.key_id, self.model.id, self.serving.session.id, outcome,
                 usage.prompt_tokens if usage else None, usage.completion_tokens if usage else None,
                 usage.cached_tokens if usage else None, (time.monotonic() - self.started) * 1000)


def _measure_decode_speed(attempt: Attempt) -> None:
    """Keep an EWMA of the session's completion tokens per second (used to rank sessions)."""
    usage, started = attempt.usage, attempt.first_content_at
    if usage is None or started is None or usage.completion_tokens < 2:
        return
    elapsed = time.monotonic() - started
    if elapsed <= 0:
        return
    observed = usage.completion_tokens / elapsed
    session = attempt.session
    session.report_speed(observed if session.decode_tps <= 0 else (
        (1 - DECODE_SPEED_WEIGHT) * session.decode_tps + DECODE_SPEED_WEIGHT * observed))
    session.link.report_speed(session.decode_tps)  # another replica's session: its holder keeps it for all
