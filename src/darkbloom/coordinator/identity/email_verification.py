"""Proving an account owns its email address: a code mailed through the coordinator's mail server
(``--smtp-url``), typed back. A verified address may accept the shares sent to it
(docs/sharing.md "Consent"); nothing else depends on it."""

from __future__ import annotations

import secrets
import time
from email.message import EmailMessage
from typing import Annotated
from urllib.parse import unquote, urlsplit

import aiosmtplib
from pydantic import Field, with_config
from sqlalchemy import delete, select, update
from typing_extensions import TypedDict

from darkbloom.coordinator.services import Services
from darkbloom.store import accounts
from darkbloom.store.db import insert_ignore
from darkbloom.store.schema import accounts as accounts_table
from darkbloom.store.schema import email_verifications
from darkbloom.wire.crypto import constant_time_equal, token_hash
from darkbloom.wire.openai.body_schema import OPEN, BodySchema
from darkbloom.wire.openai.errors import ApiError, invalid_request

CODE_ALPHABET = "ABCDEFGHJKMNPQRSTUVWXYZ23456789"  # the device codes' alphabet: nothing to misread
MAX_ATTEMPTS = 5                                     # wrong codes before a code is spent
SEND_TIMEOUT = 15.0


def _new_code() -> str:
    letters = "".join(secrets.choice(CODE_ALPHABET) for _ in range(8))
    return f"{letters[:4]}-{letters[4:]}"


def _normal(code: str) -> str:
    return "".join(code.split()).upper().replace("-", "")


async def send_code(services: Services, account_id: str) -> str:
    """Mail a new code to the account's address (replacing any earlier one); the address it went to."""
    settings = services.settings
    if not settings.smtp_url:
        raise ApiError(503, "mail_unavailable",
                       "This coordinator sends no mail (it has no --smtp-url), so it cannot verify addresses. "
                       "Ask the share's owner for its invite code instead (POST /v1/shares/accept).")
    now = int(time.time())
    async with services.engine.connect() as conn:
        account = await accounts.get(conn, account_id)
        earlier = (await conn.execute(select(email_verifications.c.sent_at).where(
            email_verifications.c.account_id == account_id))).scalar()
    assert account is not None
    if account["email"] is None:
        raise invalid_request("This account has no email address to verify.")
    if account["email_verified_at"] is not None:
        raise ApiError(409, "email_already_verified", "Your email address is already verified.")
    if earlier is not None and now - earlier < settings.email_code_interval:
        wait = settings.email_code_interval - (now - earlier)
        raise ApiError(429, "rate_limit_exceeded", f"A code was sent moments ago; you can ask for another in {wait} s.",
                       headers={"Retry-After": str(wait)})
    code = _new_code()
    async with services.engine.begin() as conn:
        await conn.execute(delete(email_verifications).where(email_verifications.c.account_id == account_id))
        await insert_ignore(conn, email_verifications, account_id=account_id, email=account["email"],
                            code_hash=token_hash(_normal(code)), attempts=0, sent_at=now,
                            expires_at=now + settings.email_code_ttl)
    try:
        await _mail(services, account["email"], code)
    except (aiosmtplib.SMTPException, OSError) as exc:
        async with services.engine.begin() as conn:  # a code nobody received must not hold back the next one
            await conn.execute(delete(email_verifications).where(email_verifications.c.account_id == account_id))
        raise ApiError(503, "mail_unavailable",
                       f"The verification mail could not be sent ({type(exc).__name__}); try again in a minute.") \
            from None
    return str(account["email"])


async def _mail(services: Services, to: str, code: str) -> None:
    settings = services.settings
    assert settings.smtp_url is not None
    url = urlsplit(settings.smtp_url)
    message = EmailMessage()
    message["From"] = settings.mail_from
    message["To"] = to
    message["Subject"] = f"Your Darkbloom verification code: {code}"
    minutes = max(1, settings.email_code_ttl // 60)
    message.set_content(
        f"Your code is {code}\n\nEnter it on the coordinator ({settings.base_url}) to verify this address; it "
        f"expires in {minutes} minutes. With a verified address you can accept machines people share with you.\n\n"
        "If you did not ask for it, ignore this mail: nothing changes until the code is entered.\n")
    implicit_tls = url.scheme == "smtps"
    await aiosmtplib.send(
        message, hostname=url.hostname or "127.0.0.1", port=url.port or (465 if implicit_tls else 25),
        username=unquote(url.username) if url.username else None,
        password=unquote(url.password) if url.password else None,
        use_tls=implicit_tls, start_tls=None if not implicit_tls else False, timeout=SEND_TIMEOUT)


@with_config(OPEN)
class EmailCode(TypedDict):
    code: Annotated[str, Field(pattern=r"\S", max_length=64, examples=["ABCD-EFGH"])]


EMAIL_CODE = BodySchema(EmailCode, {"code": "'code' must be the code from the verification mail."})


async def verify(services: Services, account_id: str, code: str) -> None:
    """The account's address is verified when ``code`` is the one last mailed to it, in time."""
    now = int(time.time())
    async with services.engine.begin() as conn:  # a wrong code's attempt is counted: it commits, then refuses
        row = (await conn.execute(select(email_verifications).where(
            email_verifications.c.account_id == account_id).with_for_update())).mappings().first()
        account = await accounts.get(conn, account_id)
        assert account is not None
        if row is None or row["attempts"] >= MAX_ATTEMPTS or row["email"] != account["email"]:
            refusal: ApiError | None = _invalid_code()
        elif row["expires_at"] <= now:
            refusal = ApiError(410, "expired_code", "This code has expired; ask for a new one.")
        elif not constant_time_equal(token_hash(_normal(code)), row["code_hash"]):
            refusal = _invalid_code()
            await conn.execute(update(email_verifications).where(email_verifications.c.account_id == account_id)
                               .values(attempts=email_verifications.c.attempts + 1))
        else:
            refusal = None
            await conn.execute(delete(email_verifications).where(email_verifications.c.account_id == account_id))
            await conn.execute(update(accounts_table).where(accounts_table.c.id == account_id)
                               .values(email_verified_at=now))
    if refusal is not None:
        raise refusal


def _invalid_code() -> ApiError:
    return ApiError(400, "invalid_code", "That is not the code we mailed you last (or it was tried too often); "
                                         "check the mail, or ask for a new code.", param="code")
