"""Device login endpoints (docs/api.md "Device login")."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from darkbloom.coordinator.identity import device_login
from darkbloom.coordinator.http.auth import require_account_writer
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.http.json_body import json_object
from darkbloom.coordinator.services import Services, get_services

router = APIRouter()


@router.post("/v1/device/code")
async def device_code(services: Services = Depends(get_services)) -> dict[str, Any]:
    return await device_login.start(services)


@router.post("/v1/device/approve")
async def approve(request: Request, caller: Caller = Depends(require_account_writer),
                  services: Services = Depends(get_services)) -> dict[str, str]:
    body = device_login.DEVICE_APPROVAL.validate(await json_object(request))
    await device_login.approve(services, caller.account_id, body["user_code"])
    return {"status": "approved"}


@router.post("/v1/device/token")
async def token(request: Request, services: Services = Depends(get_services)) -> dict[str, Any]:
    body = device_login.DEVICE_TOKEN_REQUEST.validate(await json_object(request))
    return await device_login.exchange(services, body["device_code"])
