"""Files (docs/batches.md "Files"): upload (multipart), list, read, content, delete."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect

from darkbloom.coordinator.batches import file_api
from darkbloom.coordinator.http.auth import require_caller
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.services import Services, get_services
from darkbloom.wire.openai.errors import invalid_request

router = APIRouter()


@router.post("/v1/files")
async def upload_file(request: Request, caller: Caller = Depends(require_caller),
                      services: Services = Depends(get_services)) -> dict[str, Any]:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise invalid_request("Upload a file as multipart/form-data with the fields 'file' and 'purpose'.",
                              param="file")
    try:
        form = await request.form(max_files=1, max_fields=8)
    except ClientDisconnect:
        raise
    except Exception as exc:  # noqa: BLE001 - python-multipart's and Starlette's parse errors
        raise invalid_request(f"The multipart body cannot be read: {exc}", param="file") from None
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise invalid_request("'file' is required: the file's content, as a multipart file part.", param="file")
        if not isinstance(purpose, str):
            raise invalid_request("'purpose' is required (\"batch\" for a batch input file).", param="purpose")
        content = await upload.read()
        return await file_api.upload(services, caller, purpose, upload.filename or "", content)
    finally:
        await form.close()  # the spooled file's temporary storage


@router.get("/v1/files")
async def list_files(limit: int = Query(100, ge=1, le=file_api.MAX_LIST), after: str | None = None,
                     purpose: str | None = None, caller: Caller = Depends(require_caller),
                     services: Services = Depends(get_services)) -> dict[str, Any]:
    return await file_api.listed(services, caller, limit, after, purpose)


@router.get("/v1/files/{file_id}")
async def read_file(file_id: str, caller: Caller = Depends(require_caller),
                    services: Services = Depends(get_services)) -> dict[str, Any]:
    return await file_api.read(services, caller, file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, caller: Caller = Depends(require_caller),
                       services: Services = Depends(get_services)) -> Response:
    row, content = await file_api.content_of(services, caller, file_id)
    return Response(content, media_type="application/jsonl" if row["filename"].endswith(".jsonl")
                    else "application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{_safe(row["filename"])}"'})


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, caller: Caller = Depends(require_caller),
                      services: Services = Depends(get_services)) -> dict[str, Any]:
    return await file_api.delete(services, caller, file_id)


def _safe(filename: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in filename)[:128] or "file"
