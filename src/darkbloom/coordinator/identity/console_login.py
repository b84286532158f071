"""Sign-up, log-in and log-out with an email and a password: each log-in is a new console session
(a ``dks-`` token). Argon2id password hashes; tokens stored as SHA-256. Both are throttled
(``auth_throttle``), and hashing runs on a few threads of its own."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Annotated, Any

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from pydantic import Field, with_config
from typing_extensions import TypedDict

from darkbloom.wire.openai.body_schema import OPEN, BodySchema, described
from darkbloom.wire.openai.errors import ApiError
from darkbloom.coordinator.identity import auth_throttle
from darkbloom.coordinator.identity.auth_cache import session_subject
from darkbloom.coordinator.identity.auth_invalidation import changing
from darkbloom.coordinator.services import Services
from darkbloom.wire.crypto import new_token, token_hash
from darkbloom.store import accounts, console_sessions

# Never the event loop's default executor, which DNS lookups and every to_thread share: a flood of
# log-ins waits for these threads, and hashing takes at most half the cores.
HASH_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))
_hashing = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="argon2")
MIN_PASSWORD = 8


@lru_cache(maxsize=4)
def _hasher_of(memory_kib: int, time_cost: int) -> PasswordHasher:
    return PasswordHasher(memory_cost=memory_kib, time_cost=time_cost)


def _hasher(services: Services) -> PasswordHasher:
    """argon2id at the configured cost (by default the library's: 64 MiB, 0.1-0.4 s of one core)."""
    settings = services.settings
    return _hasher_of(settings.password_hash_memory_kib, settings.password_hash_time_cost)


@with_config(OPEN)
class Credentials(TypedDict):
    email: Annotated[str, Field(max_length=320, pattern=r"^\s*[^@\s]+@[^@\s]+\.[^@\s]+\s*$",
                                json_schema_extra={"format": "email"})]
    password: Annotated[str, Field(min_length=MIN_PASSWORD, max_length=1024)]


@with_config(OPEN)
class LogIn(TypedDict, total=False):
    """Any email and password: one that cannot be right is the same 401 as a wrong one."""

    email: Annotated[Any, described({"type": "string", "format": "email"})]
    password: Annotated[Any, described({"type": "string"})]


SIGNUP = BodySchema(Credentials, {"email": "Enter a valid email address.",
                                  "password": f"The password must be {MIN_PASSWORD} to 1024 characters long."})
LOGIN = BodySchema(LogIn)


async def _hashed(work: Callable[..., object], *args: str) -> object:
    return await asyncio.get_running_loop().run_in_executor(_hashing, work, *args)


async def signup(services: Services, credentials: Credentials, address: str) -> tuple[str, str]:
    email, password = credentials["email"].strip().lower(), credentials["password"]
    await auth_throttle.take(services, auth_throttle.signup_charges(services, address))
    password_hash = str(await _hashed(_hasher(services).hash, password))
    try:
        async with services.engine.begin() as conn:
            account_id = await accounts.create_account(conn, email, password_hash)
    except accounts.EmailTaken:
        raise ApiError(409, "email_taken", "An account with this email already exists; log in instead.") from None
    return account_id, await _new_console_session(services, account_id)


async def login(services: Services, given: LogIn, address: str) -> tuple[str, str]:
    """Every attempt counts against the email and the address until it succeeds."""
    email, password = given.get("email"), given.get("password")
    if not isinstance(email, str) or not isinstance(password, str):
        raise _invalid_credentials()
    email = email.strip().lower()
    attempt = auth_throttle.login_charges(services, email, address)
    await auth_throttle.take(services, attempt)
    async with services.engine.connect() as conn:
        row = await accounts.get_by_email(conn, email)
    if row is None or not row["password_hash"]:
        await _hashed(_hasher(services).hash, password)  # same work whether or not the email exists
        raise _invalid_credentials()
    try:
        await _hashed(_hasher(services).verify, row["password_hash"], password)
    except (VerificationError, InvalidHashError):
        raise _invalid_credentials() from None
    await auth_throttle.give_back(services, attempt)
    return row["id"], await _new_console_session(services, row["id"])


async def logout(services: Services, token: str) -> None:
    digest = token_hash(token)
    async with changing(services, session_subject(digest)) as conn:
        await console_sessions.delete(conn, digest)


async def _new_console_session(services: Services, account_id: str) -> str:
    token = new_token("dks-")
    async with services.engine.begin() as conn:
        await console_sessions.create(conn, account_id, token_hash(token))
    return token


def _invalid_credentials() -> ApiError:
    return ApiError(401, "invalid_credentials", "The email or password is not correct.")
