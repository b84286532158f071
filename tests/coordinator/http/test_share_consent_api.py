"""Consent for shares (docs/sharing.md "Consent"): a share sent to an email address is answered only
by an account that proved it owns the address, with a code mailed through the coordinator's real SMTP
settings (here an aiosmtpd server); a squatter who signed up with the address first cannot take it;
an invite code binds the share to whoever redeems it; nothing says whether an email has an account."""

from __future__ import annotations

import time
from typing import Any, Iterator

import pytest

from tests.coordinator.http.conftest import Account, Api, assert_error, unique_email
from tests.support.databases import database_for
from tests.support.mailbox import Mailbox, smtp_server
from tests.support.processes import Coordinator, start_coordinator

@pytest.fixture(scope="module")
def mailbox() -> Iterator[tuple[Mailbox, int]]:
    with smtp_server() as served:
        yield served


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def coord(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          mailbox: tuple[Mailbox, int]) -> Iterator[Coordinator]:
    home = tmp_path_factory.mktemp("consent")
    with database_for(request.param, home) as url:
        process = start_coordinator(home / "home", url, "--smtp-url", f"smtp://127.0.0.1:{mailbox[1]}",
                                    "--mail-from", "coordinator@darkbloom.test",
                                    env={"DARKBLOOM_EMAIL_CODE_INTERVAL": "1"})
        try:
            yield process
        finally:
            process.stop()


def _verify(api: Api, box: Mailbox, account: Account) -> None:
    before = len(box.to(account.email))
    sent = api.post("/v1/me/email/send-code", headers=account.auth)
    assert sent.status_code == 202 and sent.json() == {"status": "sent", "email": account.email}, sent.text
    code = box.code_for(account.email, after=before)
    verified = api.post("/v1/me/email/verify", json={"code": code.lower().replace("-", " ")}, headers=account.auth)
    assert verified.status_code == 200 and verified.json()["email_verified"] is True, verified.text


def _share(api: Api, owner: Account, **fields: Any) -> dict[str, Any]:
    resp = api.post("/v1/shares", json=fields, headers=owner.auth)
    assert resp.status_code == 201, resp.text
    return dict(resp.json())


def test_a_squatter_cannot_take_a_share_sent_to_an_address_they_never_proved(
        api: Api, mailbox: tuple[Mailbox, int]) -> None:
    box, _ = mailbox
    owner = api.signup()
    partner_email = unique_email()
    given = _share(api, owner, email=partner_email)
    squatter = api.signup(partner_email)  # signs up with the partner's address before the partner does
    assert api.get("/v1/me", headers=squatter.auth).json()["email_verified"] is False
    assert api.get("/v1/shares", headers=squatter.auth).json()["received"] == []  # not even shown
    for verb in ("accept", "decline"):
        refused = api.post(f"/v1/shares/{given['id']}/{verb}", headers=squatter.auth)
        assert_error(refused, 403, "email_not_verified")
    guessed = api.post("/v1/me/email/verify", json={"code": "AAAA-AAAA"}, headers=squatter.auth)
    assert_error(guessed, 400, "invalid_code")
    owners_view = api.get("/v1/shares", headers=owner.auth).json()["given"]
    assert [(s["id"], s["status"]) for s in owners_view] == [(given["id"], "pending")]


def test_a_verified_address_accepts_the_shares_sent_to_it(api: Api, mailbox: tuple[Mailbox, int]) -> None:
    box, _ = mailbox
    owner, grantee = api.signup(), api.signup()
    machine = api.link_machine(owner)["machine_id"]
    given = _share(api, owner, email=grantee.email, machines=[machine], input_price=5, output_price=7)
    _verify(api, box, grantee)
    mail = box.to(grantee.email)[-1]
    assert mail["From"] == "coordinator@darkbloom.test" and "verification code" in mail["Subject"]
    received = api.get("/v1/shares", headers=grantee.auth).json()["received"]
    assert [(s["id"], s["status"], s["owner_email"], s["input_price"]) for s in received] == \
        [(given["id"], "pending", owner.email, 5)]
    assert list(received[0]["machine_names"]) == [machine]
    not_shown = api.post(f"/v1/shares/{given['id']}/accept", json={"input_price": 5, "output_price": 0},
                         headers=grantee.auth)
    assert_error(not_shown, 409, "share_terms_changed")
    accepted = api.post(f"/v1/shares/{given['id']}/accept",
                        json={"machines": [machine], "input_price": 5, "output_price": 7}, headers=grantee.auth)
    assert accepted.status_code == 200 and accepted.json()["status"] == "accepted", accepted.text
    assert api.post("/v1/shares/accept", json={"invite_code": given["invite_code"]},
                    headers=api.signup().auth).status_code == 404  # answered: its code is spent
    moved = api.patch(f"/v1/shares/{given['id']}", json={"output_price": 8}, headers=owner.auth)
    assert moved.status_code == 200 and moved.json()["status"] == "pending", moved.text


def test_a_wrong_code_counts_and_five_spend_it(api: Api, mailbox: tuple[Mailbox, int]) -> None:
    box, _ = mailbox
    account = api.signup()
    assert api.post("/v1/me/email/send-code", headers=account.auth).status_code == 202
    code = box.code_for(account.email)
    wrong = "ZZZZ-ZZZZ" if code != "ZZZZ-ZZZZ" else "YYYY-YYYY"
    for _ in range(5):
        assert_error(api.post("/v1/me/email/verify", json={"code": wrong}, headers=account.auth), 400, "invalid_code")
    spent = api.post("/v1/me/email/verify", json={"code": code}, headers=account.auth)
    assert_error(spent, 400, "invalid_code")
    assert api.get("/v1/me", headers=account.auth).json()["email_verified"] is False
    again = api.post("/v1/me/email/send-code", headers=account.auth)
    while again.status_code == 429:  # one code a second here (DARKBLOOM_EMAIL_CODE_INTERVAL)
        assert_error(again, 429, "rate_limit_exceeded")
        time.sleep(1.1)
        again = api.post("/v1/me/email/send-code", headers=account.auth)
    assert again.status_code == 202, again.text
    fresh = box.code_for(account.email, after=1)
    assert api.post("/v1/me/email/verify", json={"code": fresh}, headers=account.auth).status_code == 200
    assert_error(api.post("/v1/me/email/send-code", headers=account.auth), 409, "email_already_verified")


def test_restricted_keys_and_device_tokens_cannot_answer_or_verify(api: Api) -> None:
    owner, grantee = api.signup(), api.signup()
    given = _share(api, owner, email=grantee.email)
    restricted = api.create_key(grantee, name="capped", max_shared_price=0)["key"]
    device = api.link_machine(grantee)["token"]
    for path, body in (("/v1/shares/accept", {"invite_code": given["invite_code"]}),
                       (f"/v1/shares/{given['id']}/accept", {}), ("/v1/me/email/send-code", {})):
        refused = api.post(path, json=body, headers={"Authorization": f"Bearer {restricted}"})
        assert_error(refused, 403, "key_restricted")
        assert_error(api.post(path, json=body, headers={"Authorization": f"Bearer {device}"}), 403, "forbidden")
    assert api.get("/v1/shares", headers=owner.auth).json()["given"][0]["status"] == "pending"


def test_bad_answers_are_named_and_change_nothing(api: Api) -> None:
    owner, other = api.signup(), api.signup()
    given = _share(api, owner, email=unique_email())
    for body in ({}, {"invite_code": 7}, {"invite_code": " "}, {"invite_code": "x" * 300}):
        assert_error(api.post("/v1/shares/accept", json=body, headers=other.auth), 400, "invalid_request_error")
    assert_error(api.post("/v1/shares/accept", json={"invite_code": "dki-wrong"}, headers=other.auth),
                 404, "share_not_found")
    assert_error(api.post(f"/v1/shares/{given['id']}/accept", json={"input_price": -1}, headers=other.auth),
                 400, "invalid_request_error")
    assert_error(api.post(f"/v1/shares/{given['id']}/accept", json={"surprise": 1}, headers=other.auth),
                 400, "invalid_request_error")
    for who in (owner, other):  # the owner cannot answer their own share; a stranger cannot see it
        assert_error(api.post(f"/v1/shares/{given['id']}/accept", headers=who.auth), 404, "share_not_found")
    assert_error(api.patch(f"/v1/shares/{given['id']}", json={"email": "x@example.com"}, headers=owner.auth),
                 400, "invalid_request_error")
    assert_error(api.patch(f"/v1/shares/{given['id']}", json={"input_price": 1}, headers=other.auth),
                 404, "share_not_found")
    assert_error(api.post("/v1/me/email/verify", json={"code": "ABCD-EFGH"}, headers=other.auth), 400, "invalid_code")
    listed = api.get("/v1/shares", headers=owner.auth).json()["given"]
    assert [(s["id"], s["status"], s["input_price"]) for s in listed] == [(given["id"], "pending", 0)]


def test_without_mail_settings_verification_says_to_use_an_invite_code(tmp_path: Any) -> None:
    with database_for("sqlite", tmp_path) as url:
        process = start_coordinator(tmp_path / "home", url)
        api = Api(process)
        try:
            account = api.signup()
            assert_error(api.post("/v1/me/email/send-code", headers=account.auth), 503, "mail_unavailable")
        finally:
            api.close()
            process.stop()


def test_redeeming_an_invite_is_one_resource_not_a_share_named_accept(api: Api) -> None:
    account = api.signup()
    assert api.request("OPTIONS", "/v1/shares/accept").headers["allow"] == "OPTIONS, POST"
    for method in ("DELETE", "PATCH"):
        refused = api.request(method, "/v1/shares/accept", headers=account.auth, json={})
        assert_error(refused, 405, "method_not_allowed")
    assert_error(api.get("/v1/shares/accept/usage", headers=account.auth), 404, "share_not_found")
