"""Machine stats, usage per day and usage as CSV: their shapes, bounds and who may read them."""

from __future__ import annotations

import datetime

from tests.coordinator.http.conftest import Api, assert_error

REASONS = {"busy", "trust_floor", "private_only", "challenge_stale", "runtime_unverified", "capability",
           "unverified_weights", "context_length", "another_machine_chosen"}


def test_machine_stats_for_the_owner_only(api: Api) -> None:
    owner, other = api.signup(), api.signup()
    machine = api.link_machine(owner)["machine_id"]
    resp = api.get(f"/v1/me/providers/{machine}/stats", headers=owner.auth)
    assert resp.status_code == 200, resp.text
    stats = resp.json()
    assert stats["hours"] == 24
    assert stats["requests"] == {"owned": 0, "shared": 0, "fleet": 0}
    assert (stats["prompt_tokens"], stats["completion_tokens"], stats["earnings_micro_usd"]) == (0, 0, 0)
    assert stats["busy_fraction"] is None and stats["decode_tps_p50"] is None
    assert stats["passed_over"] == {reason: 0 for reason in REASONS}
    hours = [entry["hour"] for entry in stats["hourly"]]
    assert len(hours) == 24 and hours == sorted(hours) and all(b - a == 3600 for a, b in zip(hours, hours[1:]))
    assert api.get(f"/v1/me/providers/{machine}/stats?hours=3", headers=owner.auth).json()["hours"] == 3
    for path in (f"/v1/me/providers/{machine}/stats", "/v1/me/providers/mach_doesnotexist/stats"):
        assert_error(api.get(path, headers=other.auth), 404, "machine_not_found")
    for hours_param in ("0", "721"):
        assert_error(api.get(f"/v1/me/providers/{machine}/stats?hours={hours_param}", headers=owner.auth),
                     400, "invalid_request_error")


def test_usage_per_day_and_as_csv(api: Api) -> None:
    account = api.signup()
    before = datetime.datetime.now(datetime.timezone.utc).date()
    resp = api.get("/v1/payments/usage/daily", headers=account.auth)
    assert resp.status_code == 200, resp.text
    days = resp.json()["data"]
    after = datetime.datetime.now(datetime.timezone.utc).date()
    today = after if days[-1]["date"] == after.isoformat() else before  # the call may straddle 00:00 UTC
    assert [d["date"] for d in days] == [(today - datetime.timedelta(days=29 - i)).isoformat() for i in range(30)]
    assert all(d["requests"] == d["prompt_tokens"] == d["completion_tokens"] == d["cost_micro_usd"] == 0
               for d in days)
    assert len(api.get("/v1/payments/usage/daily?days=1", headers=account.auth).json()["data"]) == 1
    for bad in ("0", "367"):
        assert_error(api.get(f"/v1/payments/usage/daily?days={bad}", headers=account.auth), 400,
                     "invalid_request_error")
    csv = api.get("/v1/payments/usage.csv", headers=account.auth)
    assert csv.status_code == 200 and csv.headers["content-type"].startswith("text/csv")
    assert csv.text == ("request_id,created_at,model,provider_id,prompt_tokens,completion_tokens,"
                        "cost_micro_usd,self_routed,routed,share_id\r\n")
    assert api.get("/v1/payments/usage.csv").status_code == 401
