"""Sign-up, log-in, balance and the caller's linked machines."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from darkbloom.coordinator.identity import console_login, device_login, email_verification
from darkbloom.coordinator.identity.auth_throttle import client_address
from darkbloom.coordinator.http.auth import bearer_token, require_account_writer, require_caller
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.http.json_body import json_object
from darkbloom.coordinator.fleet.machines import linked_machines
from darkbloom.coordinator.fleet.machines import machine_stats as stats_of
from darkbloom.coordinator.services import Services, get_services
from darkbloom.store import accounts

router = APIRouter()


@router.post("/v1/auth/signup", status_code=201)
async def signup(request: Request, services: Services = Depends(get_services)) -> dict[str, str]:
    credentials = console_login.SIGNUP.validate(await json_object(request))
    account_id, token = await console_login.signup(services, credentials, client_address(request))
    return {"account_id": account_id, "token": token}


@router.post("/v1/auth/login")
async def login(request: Request, services: Services = Depends(get_services)) -> dict[str, str]:
    given = console_login.LOGIN.validate(await json_object(request))
    account_id, token = await console_login.login(services, given, client_address(request))
    return {"account_id": account_id, "token": token}


@router.post("/v1/auth/logout")
async def logout(request: Request, caller: Caller = Depends(require_caller),
                 services: Services = Depends(get_services)) -> dict[str, str]:
    token = bearer_token(request)
    if caller.kind == "console_session" and token:
        await console_login.logout(services, token)
    return {"status": "logged_out"}


@router.get("/v1/me")
async def me(caller: Caller = Depends(require_caller), services: Services = Depends(get_services)) -> dict[str, Any]:
    async with services.engine.connect() as conn:
        account = await accounts.get(conn, caller.account_id)
    assert account is not None
    return {"id": account["id"], "object": "account", "email": account["email"],
            "email_verified": account["email_verified_at"] is not None, "created_at": account["created_at"]}


@router.post("/v1/me/email/send-code", status_code=202)
async def send_email_code(caller: Caller = Depends(require_account_writer),
                          services: Services = Depends(get_services)) -> dict[str, str]:
    """A verification code, mailed to the account's address (docs/sharing.md "Consent")."""
    email = await email_verification.send_code(services, caller.account_id)
    return {"status": "sent", "email": email}


@router.post("/v1/me/email/verify")
async def verify_email(request: Request, caller: Caller = Depends(require_account_writer),
                       services: Services = Depends(get_services)) -> dict[str, Any]:
    body = email_verification.EMAIL_CODE.validate(await json_object(request))
    await email_verification.verify(services, caller.account_id, body["code"])
    return await me(caller, services)


@router.get("/v1/me/providers")
async def my_providers(caller: Caller = Depends(require_caller),
                       services: Services = Depends(get_services)) -> dict[str, Any]:
    return {"object": "list", "data": await linked_machines(services, caller.account_id), "next_cursor": None}


@router.get("/v1/me/providers/{machine_id}/stats")
async def machine_stats(machine_id: str, hours: int = Query(24), caller: Caller = Depends(require_caller),
                        services: Services = Depends(get_services)) -> dict[str, Any]:
    return await stats_of(services, caller.account_id, machine_id, hours)


@router.delete("/v1/me/providers/{machine_id}")
async def unlink(machine_id: str, caller: Caller = Depends(require_account_writer),
                 services: Services = Depends(get_services)) -> JSONResponse:
    await device_login.unlink_machine(services, caller.account_id, machine_id)
    return JSONResponse({"id": machine_id, "deleted": True})
