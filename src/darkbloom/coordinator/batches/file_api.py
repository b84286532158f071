"""OpenAI's Files API over the account's stored files: upload (a batch input file is checked line by
line first), list, read, content, delete. A caller sees only its own account's files; any other id
is ``file_not_found``."""

from __future__ import annotations

import asyncio
from typing import Any

from darkbloom.coordinator.batches.input_file import check_input_file
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.services import Services
from darkbloom.store import files
from darkbloom.wire.openai.errors import ApiError, invalid_request

UPLOAD_PURPOSES = ("batch", "assistants", "fine-tune", "vision", "user_data", "evals")  # OpenAI's; "batch" runs here
RESULT_PURPOSES = ("batch_output", "batch_error")
MAX_FILENAME = 256
MAX_LIST = 10_000


def file_not_found() -> ApiError:
    """One answer for a file that does not exist and one that is another account's."""
    return ApiError(404, "file_not_found", "No such file among your account's files. GET /v1/files lists them.",
                    param="file_id")


def file_view(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "status_details": None}


async def upload(services: Services, caller: Caller, purpose: str, filename: str, content: bytes) -> dict[str, Any]:
    if purpose not in UPLOAD_PURPOSES:
        raise invalid_request(f"'purpose' must be one of {', '.join(UPLOAD_PURPOSES)}.", param="purpose")
    filename = filename.strip()[:MAX_FILENAME] or "upload.jsonl"
    settings = services.settings
    if len(content) > settings.batch_max_file_bytes:
        raise invalid_request(f"The file is {len(content)} bytes; a file may be at most "
                              f"{settings.batch_max_file_bytes} bytes.", param="file")
    lines = None
    if purpose == "batch":
        checked = await asyncio.to_thread(check_input_file, content, max_lines=settings.batch_max_lines,
                                          max_body_bytes=settings.max_body_bytes)
        lines = len(checked)
    async with services.engine.begin() as conn:
        row = await files.create(conn, caller.account_id, purpose, filename, content, lines)
    return file_view(row)


def list_page(shown: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's list of files or batches: ``shown`` in order, and whether more follow (``after``)."""
    return {"object": "list", "data": shown, "has_more": has_more,
            "first_id": shown[0]["id"] if shown else None, "last_id": shown[-1]["id"] if shown else None}


async def listed(services: Services, caller: Caller, limit: int, after: str | None,
                 purpose: str | None) -> dict[str, Any]:
    async with services.engine.connect() as conn:
        rows = await files.list_for(conn, caller.account_id, limit + 1, after, purpose)
    return list_page([file_view(r) for r in rows[:limit]], len(rows) > limit)


async def read(services: Services, caller: Caller, file_id: str) -> dict[str, Any]:
    async with services.engine.connect() as conn:
        row = await files.get(conn, caller.account_id, file_id)
    if row is None:
        raise file_not_found()
    return file_view(row)


async def content_of(services: Services, caller: Caller, file_id: str) -> tuple[dict[str, Any], bytes]:
    async with services.engine.connect() as conn:
        row = await files.get(conn, caller.account_id, file_id)
        content = await files.content(conn, caller.account_id, file_id) if row else None
    if row is None or content is None:
        raise file_not_found()
    return row, content


async def delete(services: Services, caller: Caller, file_id: str) -> dict[str, Any]:
    async with services.engine.begin() as conn:
        if not await files.remove(conn, caller.account_id, file_id):
            raise file_not_found()
    return {"id": file_id, "object": "file", "deleted": True}
