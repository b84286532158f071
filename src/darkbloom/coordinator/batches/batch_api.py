"""OpenAI's Batch API over stored batches: create (the input file checked again, its lines stored, the
route fixed from the headers and the key as a live request's would be), read, list, cancel. The
batch object is OpenAI's, with ``darkbloom_route`` (self | shared | prefer | fleet) and
``cost_micro_usd`` (what its lines were charged so far)."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Literal

from pydantic import Field, with_config
from starlette.datastructures import Headers
from typing_extensions import NotRequired, TypedDict

from darkbloom.coordinator.batches.file_api import file_not_found, list_page
from darkbloom.coordinator.batches.input_file import BATCH_EDGES, check_input_file
from darkbloom.coordinator.identity.caller import Caller
from darkbloom.coordinator.money import admission
from darkbloom.coordinator.routing import route
from darkbloom.coordinator.routing.route import MACHINE_HEADER, ROUTE_HEADER, SHARE_HEADER
from darkbloom.coordinator.routing.selfroute import no_linked_machine
from darkbloom.coordinator.routing.sharing import load_grants, no_shared_machine
from darkbloom.coordinator.services import Services
from darkbloom.store import batches, files, machines
from darkbloom.wire.crypto import new_id
from darkbloom.wire.openai.body_schema import CLOSED, BodySchema
from darkbloom.wire.openai.errors import ApiError, invalid_request

WINDOW_SECONDS = {"24h": 24 * 3600}
ROUTE_NAMES = {"exclusive": "self", "shared": "shared", "prefer": "prefer", "public": "fleet"}
MAX_LIST = 100
_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
          "cancelling_at", "cancelled_at")

BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


@with_config(CLOSED)
class BatchCreate(TypedDict):
    input_file_id: Annotated[str, Field(min_length=1, max_length=64, description=(
        "A file uploaded with purpose \"batch\": one request per line."))]
    endpoint: Annotated[BatchEndpoint, Field(description="Every line's url must be this endpoint.")]
    completion_window: Literal["24h"]
    metadata: NotRequired[Annotated[Metadata | None, Field(description=(
        "Up to 16 pairs: keys of at most 64 characters, values of at most 512."))]]


BATCH_CREATE = BodySchema(BatchCreate, {
    "input_file_id": "'input_file_id' must be the id of a file you uploaded (file-…).",
    "endpoint": f"'endpoint' must be one of {', '.join(BATCH_EDGES)}.",
    "completion_window": "'completion_window' must be \"24h\".",
    "metadata": "'metadata' must be an object of at most 16 string values (keys ≤ 64 characters, values ≤ 512).",
}, unknown="Unknown batch field(s): {names}. A batch takes {known}.")


def route_headers(batch: dict[str, Any]) -> Headers:
    """The routing headers the batch was created with, which each of its lines is sent with: its
    policy is resolved per line with the key as it is then (a key made ``self_route_only`` since keeps
    its lines on its owner's machines, as it would a live request)."""
    values = {ROUTE_HEADER: batch["route"]} if batch["route"] != "fleet" else {}
    if batch["pinned_machine_id"] is not None:
        values[MACHINE_HEADER] = batch["pinned_machine_id"]
    if batch["share_id"] is not None:
        values[SHARE_HEADER] = batch["share_id"]
    return Headers(values)


def batch_not_found() -> ApiError:
    """One answer for a batch that does not exist and one that is another account's."""
    return ApiError(404, "batch_not_found", "No such batch among your account's batches. GET /v1/batches lists "
                                            "them.", param="batch_id")


def batch_view(row: dict[str, Any], cost: int) -> dict[str, Any]:
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"], "errors": None,
            "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
            "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            **{name: row[name] for name in _TIMES},
            "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
            "metadata": row["metadata"], "darkbloom_route": row["route"], "cost_micro_usd": cost}


async def create(services: Services, caller: Caller, headers: Headers, body: dict[str, Any]) -> dict[str, Any]:
    BATCH_CREATE.validate(body)
    await admission.take_request(services, caller)  # creating a batch is one request against RPM
    policy = route.resolve_policy(headers, caller)
    file_id, endpoint = body["input_file_id"], body["endpoint"]
    async with services.engine.connect() as conn:
        found = await files.get(conn, caller.account_id, file_id)
        content = await files.content(conn, caller.account_id, file_id) if found else None
        ever_linked = await machines.ever_linked(conn, caller.account_id)
    if found is None or content is None:
        raise file_not_found()
    if found["purpose"] != "batch":
        raise invalid_request(f"File {file_id} was uploaded with purpose '{found['purpose']}'; a batch runs a file "
                              "uploaded with purpose 'batch'.", param="input_file_id")
    settings = services.settings
    lines = await asyncio.to_thread(check_input_file, content, max_lines=settings.batch_max_lines,
                                    max_body_bytes=settings.max_body_bytes)
    other = next((line for line in lines if line.url != endpoint), None)
    if other is not None:
        raise invalid_request(f"Line {other.line_no} of the file is a {other.url} request, but the batch's endpoint "
                              f"is {endpoint}: every line's url must be the batch's endpoint.", param="endpoint")
    if policy.exclusive and not ever_linked:
        raise no_linked_machine()  # as a live self-route request would be
    if policy.shared:
        grants = await load_grants(services, caller, policy.share_id)  # the share it names, checked as live
        if not ever_linked and not grants.usable and not grants.exhausted:
            raise no_shared_machine()
    now = int(time.time())
    row = {"id": new_id("batch_"), "account_id": caller.account_id, "caller_kind": caller.kind,
           "key_id": caller.key_id, "machine_id": caller.machine_id, "input_file_id": file_id, "endpoint": endpoint,
           "completion_window": body["completion_window"], "route": ROUTE_NAMES[policy.mode],
           "pinned_machine_id": policy.pinned, "share_id": policy.share_id, "status": "validating",
           "metadata": body.get("metadata"), "total": len(lines), "created_at": now,
           "expires_at": now + WINDOW_SECONDS[body["completion_window"]]}
    async with services.engine.begin() as conn:
        await batches.create(conn, row, ((line.line_no, line.custom_id, line.body) for line in lines))
        stored = await batches.get(conn, caller.account_id, row["id"])
    assert stored is not None
    return batch_view(stored, 0)


async def read(services: Services, caller: Caller, batch_id: str) -> dict[str, Any]:
    async with services.engine.connect() as conn:
        row = await batches.get(conn, caller.account_id, batch_id)
        if row is None:
            raise batch_not_found()
        cost = await batches.cost_of(conn, [batch_id])
    return batch_view(row, cost.get(batch_id, 0))


async def listed(services: Services, caller: Caller, limit: int, after: str | None) -> dict[str, Any]:
    async with services.engine.connect() as conn:
        rows = await batches.list_for(conn, caller.account_id, limit + 1, after)
        shown = rows[:limit]
        costs = await batches.cost_of(conn, [row["id"] for row in shown])
    return list_page([batch_view(row, costs.get(row["id"], 0)) for row in shown], len(rows) > limit)


async def cancel(services: Services, caller: Caller, batch_id: str) -> dict[str, Any]:
    """Lines already running finish; the rest are cancelled when the runner next looks (at once: its
    next round). A batch already cancelling or cancelled is answered as it is."""
    now = int(time.time())
    async with services.engine.begin() as conn:
        row = await batches.get(conn, caller.account_id, batch_id)
        if row is None:
            raise batch_not_found()
        if not await batches.set_status(conn, batch_id, ("validating", "in_progress"), "cancelling",
                                        cancelling_at=now) and row["status"] not in ("cancelling", "cancelled"):
            raise _not_cancellable(row["status"])
    return await read(services, caller, batch_id)


def _not_cancellable(status: str) -> ApiError:
    return ApiError(409, "batch_not_cancellable", f"This batch is {status}: only a batch that is validating or in "
                                                  "progress can be cancelled.")
