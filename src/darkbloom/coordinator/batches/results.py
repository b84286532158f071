"""A batch's results: each line's output- or error-file line (OpenAI's shapes), and the batch's end —
the output file (answered lines) and the error file (failed, expired and cancelled lines) written
once, by the coordinator that wins the batch's ``finalizing``. An answer's ``usage.cost_micro_usd``
is read from its usage row when the file is written, so the file says what the ledger charged."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from darkbloom.coordinator.services import Services
from darkbloom.store import batches, files
from darkbloom.wire.openai.errors import ApiError

# a live error's code, in the batch error file's words where they differ
_BATCH_CODES = {"insufficient_quota": "insufficient_balance", "insufficient_funds": "insufficient_balance",
                "spend_cap_exceeded": "spend_limit_exceeded"}
_UNRUN = {"expired": ("batch_expired", "The batch's completion window ended before this request ran; it was not "
                                       "charged."),
          "cancelled": ("batch_cancelled", "The batch was cancelled before this request ran; it was not charged.")}


def line_id(batch_id: str, custom_id: str) -> str:
    """A line's id in the result files (``batch_req_…``), derived from its batch and custom_id."""
    return "batch_req_" + _digest(batch_id, custom_id)


def request_id(batch_id: str, custom_id: str, attempt: int, id_prefix: str) -> str:
    """The request id (and ledger reference) of one attempt at a line, derived from the batch, the
    custom_id and the attempt: a line is charged only by the attempt that answered it."""
    return id_prefix + _digest(batch_id, custom_id, str(attempt))


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def answer_line(batch_id: str, custom_id: str, request_id: str, body: dict[str, Any]) -> str:
    return _dumps({"id": line_id(batch_id, custom_id), "custom_id": custom_id,
                   "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None})


def error_line(batch_id: str, custom_id: str, request_id: str | None, error: ApiError) -> str:
    """A line that failed as a live request would have: the live answer's status and error body."""
    response = ({"status_code": error.status, "request_id": request_id, "body": error.body()}
                if request_id is not None else None)
    code = _BATCH_CODES.get(error.code, error.code)
    return _dumps({"id": line_id(batch_id, custom_id), "custom_id": custom_id, "response": response,
                   "error": {"code": code, "message": error.message}})


def _dumps(value: dict[str, Any]) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


async def finalize(services: Services, batch: dict[str, Any]) -> bool:
    """Write the result files of a batch this coordinator moved to ``finalizing``, and close it:
    ``cancelled`` when it was cancelled, ``expired`` when lines expired, else ``completed``."""
    batch_id, account_id = batch["id"], batch["account_id"]
    output: list[str] = []
    errors: list[str] = []
    expired = False
    async with services.engine.connect() as conn:
        charged = await batches.charges(conn, batch_id)
        for line in await batches.stream_lines(conn, batch_id):
            state = line["state"]
            if state == "answered":
                output.append(_with_cost(line["result"], charged.get(line["request_id"], 0)))
            elif state == "failed":
                errors.append(line["result"])
            elif state in _UNRUN:
                expired = expired or state == "expired"
                code, message = _UNRUN[state]
                errors.append(_dumps({"id": line_id(batch_id, line["custom_id"]), "custom_id": line["custom_id"],
                                      "response": None, "error": {"code": code, "message": message}}))
    status = "cancelled" if batch["cancelling_at"] is not None else "expired" if expired else "completed"
    try:
        async with services.engine.begin() as conn:
            output_file = await files.create(conn, account_id, "batch_output", f"{batch_id}_output.jsonl",
                                             _jsonl(output)) if output else None
            error_file = await files.create(conn, account_id, "batch_error", f"{batch_id}_error.jsonl",
                                            _jsonl(errors)) if errors else None
            if not await batches.close(conn, batch_id, status, output_file["id"] if output_file else None,
                                       error_file["id"] if error_file else None, len(output), len(errors),
                                       int(time.time())):
                raise _ClosedElsewhere  # another coordinator took the finalizing over and closed it: no files
    except _ClosedElsewhere:
        return False
    return True


class _ClosedElsewhere(Exception):
    pass


def _with_cost(result: str, cost: int) -> str:
    line = json.loads(result)
    usage = line["response"]["body"].get("usage")
    if isinstance(usage, dict):
        usage["cost_micro_usd"] = cost
    return _dumps(line)


def _jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()
