"""What each route of the coordinator takes and answers, for the OpenAPI document: its request body,
its successful answers and every error status it can return with the ``code``s behind it (the
routes and the modules they call raise them; docs/api.md "Error codes" lists them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from darkbloom.coordinator.http.sealed_body import SEALED_CONTENT_TYPE
from darkbloom.wire.catalog import BUNDLED_MODEL_ID

# the response headers of an inference answer (the cost one on non-streamed answers only)
ROUTED = ("X-Request-Id", "X-Provider-Id", "X-Darkbloom-Routed", "X-Darkbloom-Billing", "X-Darkbloom-Cost-Micro-USD")

Auth = Literal["caller", "manager", "admin"]


@dataclass(frozen=True)
class Answer:
    """A successful (or otherwise non-envelope) response: media type → schema name."""

    description: str
    content: dict[str, str] = field(default_factory=dict)
    headers: tuple[str, ...] = ()  # names in document.HEADERS


def json_answer(schema: str, description: str) -> Answer:
    return Answer(description, {"application/json": schema})


@dataclass(frozen=True)
class Operation:
    tag: str
    summary: str
    answers: dict[int, Answer]
    auth: Auth | None = None
    body: dict[str, str] | None = None       # media type → schema name
    body_required: bool = True
    errors: dict[int, tuple[str, ...]] = field(default_factory=dict)  # status → error codes
    route_headers: tuple[str, ...] = ()      # Self-Route request headers the route reads
    description: str | None = None
    examples: dict[str, Any] = field(default_factory=dict)  # named JSON request bodies
    error_schema: str = "Error"              # the error envelope's schema (Anthropic's on /v1/messages)


def _json_body(schema: str) -> dict[str, str]:
    return {"application/json": schema}


INVALID = ("invalid_request_error",)
_HELLO = [{"role": "user", "content": "Say hello."}]
_CHAT_EXAMPLES = {
    "plain": {"model": BUNDLED_MODEL_ID, "messages": _HELLO, "max_tokens": 16},
    "streamed": {"model": BUNDLED_MODEL_ID, "messages": _HELLO, "stream": True,
                 "stream_options": {"include_usage": True}},
    "parts": {"model": BUNDLED_MODEL_ID, "temperature": 0.2,
              "messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]},
}
CHAT_ERRORS = {
    400: ("invalid_request_error", "invalid_sealed_envelope", "kid_mismatch", "decryption_failed",
          "context_length_exceeded", "model_capability_unsupported"),
    402: ("insufficient_quota (type insufficient_funds)", "spend_cap_exceeded"),
    403: ("model_not_allowed", "share_price_above_key_ceiling"),
    404: ("model_not_found", "machine_not_found", "share_not_found"),
    409: ("no_linked_machine", "no_shared_machine", "share_not_accepted"),
    429: ("rate_limit_exceeded", "queue_full (type rate_limit_exceeded)",
          "queue_timeout (type rate_limit_exceeded)", "machine_busy", "share_quota_exceeded"),
    502: ("provider_error", "provider_unavailable", "untrusted_chunk", "untrusted_usage",
          "request_crashed_providers (type provider_error)", "frame_too_large (type provider_error)"),
    503: ("model_unavailable", "model_capability_unsupported (type model_unavailable)", "model_routing_blocked",
          "model_not_loaded", "machine_offline", "service_unavailable"),
    504: ("provider_timeout",),
}

_THROTTLED = {429: ("rate_limit_exceeded",), 503: ("service_unavailable",)}

_BATCH_ROUTE_ERRORS = {400: INVALID, 404: ("file_not_found", "share_not_found"),
                       409: ("no_linked_machine", "no_shared_machine", "share_not_accepted"),
                       429: ("rate_limit_exceeded",)}

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("get", "/health"): Operation("public", "Liveness", {200: json_answer("HealthStatus", "The process is up.")}),
    ("get", "/readyz"): Operation("public", "Readiness (the database is reachable)", {
        200: json_answer("ReadyStatus", "Ready to serve."),
        503: json_answer("ReadyStatus", "The database is unreachable.")}),
    ("get", "/metrics"): Operation("public", "Prometheus metrics", {
        200: Answer("Prometheus text exposition format.", {"text/plain": "MetricsText"})}),
    ("get", "/v1/encryption-key"): Operation("public", "The key a request body may be sealed to", {
        200: json_answer("EncryptionKey", "The coordinator's X25519 public key (docs/api.md, \"Sealed bodies\").")}),
    ("get", "/openapi.json"): Operation("public", "This document", {
        200: json_answer("OpenApiDocument", "The OpenAPI document of the coordinator.")}),
    ("post", "/v1/chat/completions"): Operation(
        "inference", "Create a chat completion", auth="caller",
        body={**_json_body("ChatCompletionRequest"), SEALED_CONTENT_TYPE: "SealedRequest"},
        route_headers=("X-Darkbloom-Route", "X-Darkbloom-Machine", "X-Darkbloom-Share"), errors=CHAT_ERRORS, examples=_CHAT_EXAMPLES,
        answers={200: Answer("The completion (`stream: false`), or its server-sent events (`stream: true`); "
                             "sealed back when the request was sealed.",
                             {"application/json": "ChatCompletion", "text/event-stream": "ChatCompletionEvent",
                              SEALED_CONTENT_TYPE: "SealedResponse"},
                             ROUTED)},
        description="OpenAI chat completions through the fleet or, with Self-Route, on your own machines."),
    ("get", "/v1/models"): Operation(
        "inference", "List the models you can use", {200: json_answer("ModelList", "OpenAI list shape.")},
        auth="caller", route_headers=("X-Darkbloom-Route",),
        description="The public catalog of routable models, or with an exclusive self-route policy "
                    "(`X-Darkbloom-Route: self` or a self_route_only key) your own machines' models."),
    ("get", "/v1/models/catalog"): Operation(
        "public", "The model catalog", {200: json_answer(
            "CatalogList", "Every catalog model with its prices (µUSD per 1M tokens) and, where known, the "
                           "Hugging Face source, size, context length and weight hash of its GGUF.")}),
    ("get", "/v1/models/{model_id}"): Operation(
        "inference", "One model", {200: json_answer("Model", "The model, under the id you asked for.")},
        auth="caller", route_headers=("X-Darkbloom-Route",), errors={404: ("model_not_found",)}),
    ("get", "/v1/me/self-route-models"): Operation(
        "inference", "What your own online machines can serve",
        {200: json_answer("SelfRouteModels", "Sorted model ids.")}, auth="caller"),
    ("post", "/v1/auth/signup"): Operation(
        "accounts", "Create an account", {201: json_answer("Session", "The account and a console session.")},
        body=_json_body("Credentials"), errors={400: INVALID, 409: ("email_taken",), **_THROTTLED},
        description="By default at most 20 sign-ups per client address an hour (429 with Retry-After)."),
    ("post", "/v1/auth/login"): Operation(
        "accounts", "Log in", {200: json_answer("Session", "A new console session (dks-).")},
        body=_json_body("LogIn"), errors={400: INVALID, 401: ("invalid_credentials",), **_THROTTLED},
        description="By default at most 10 failed log-ins per email and 100 per client address in 15 minutes "
                    "(429 with Retry-After); a successful log-in is not counted."),
    ("post", "/v1/auth/logout"): Operation(
        "accounts", "End this console session", {200: json_answer("Status", "`{\"status\": \"logged_out\"}`.")},
        auth="caller", errors={403: ("forbidden",)}),
    ("get", "/v1/me/providers"): Operation(
        "accounts", "Your linked machines", {200: json_answer("MachineList", "Every linked machine.")},
        auth="caller"),
    ("delete", "/v1/me/providers/{machine_id}"): Operation(
        "accounts", "Unlink a machine (revokes its device token)",
        {200: json_answer("Unlinked", "Unlinked.")}, auth="caller",
        errors={400: INVALID, 403: ("forbidden",), 404: ("machine_not_found",)}),
    ("get", "/v1/me/providers/{machine_id}/stats"): Operation(
        "accounts", "What your machine did over the last hours, and why it was passed over",
        {200: json_answer("MachineStats", "Requests, tokens, earnings, busy fraction, decode speed, the public "
                                          "requests it was passed over for by reason, and requests per hour.")},
        auth="caller", errors={400: INVALID, 404: ("machine_not_found",)},
        description="`?hours=` 1–720 (default 24). See docs/api.md \"Machine stats\" for what each figure counts."),
    ("get", "/v1/payments/balance"): Operation(
        "payments", "Your balance", {200: json_answer("Balance", "µUSD.")}, auth="caller"),
    ("get", "/v1/payments/usage"): Operation(
        "payments", "Your usage rows, newest first", {200: json_answer("UsagePage", "One page.")},
        auth="caller", errors={400: INVALID}),
    ("get", "/v1/payments/usage.csv"): Operation(
        "payments", "Your usage rows as CSV, newest first",
        {200: Answer("A header line, then one line per usage row (at most 100,000).", {"text/csv": "UsageCsv"})},
        auth="caller"),
    ("get", "/v1/payments/usage/daily"): Operation(
        "payments", "Your usage per UTC day, oldest first",
        {200: json_answer("UsageDaily", "One entry per day of the last `days` (1–366, default 30), today last; "
                                        "days without use as zeros.")},
        auth="caller", errors={400: INVALID}),
    ("get", "/v1/provider/earnings"): Operation(
        "payments", "Payouts to your machines", {200: json_answer("EarningsPage", "One page and the total.")},
        auth="caller", errors={400: INVALID}),
    ("post", "/v1/keys"): Operation(
        "keys", "Create an API key", {201: json_answer("ApiKeyWithSecret", "The key; `key` is shown only here.")},
        auth="manager", body=_json_body("ApiKeyCreate"), errors={400: INVALID}, examples={
            "my_machine_only": {"name": "laptop", "self_route_only": True},
            "capped": {"name": "ci", "limit_usd": 5, "limit_reset": "monthly", "rpm_limit": 60,
                       "allowed_models": [BUNDLED_MODEL_ID]}}),
    ("get", "/v1/keys"): Operation(
        "keys", "List your API keys", {200: json_answer("ApiKeyList", "One page (never the secrets).")},
        auth="manager", errors={400: INVALID}),
    ("get", "/v1/keys/{key_id}"): Operation(
        "keys", "One API key", {200: json_answer("ApiKey", "The key (never the secret).")},
        auth="manager", errors={400: INVALID, 404: ("key_not_found",)}),
    ("patch", "/v1/keys/{key_id}"): Operation(
        "keys", "Edit an API key", {200: json_answer("ApiKey", "The edited key.")}, auth="manager",
        body=_json_body("ApiKeyUpdate"), body_required=False, errors={400: INVALID, 404: ("key_not_found",)}),
    ("post", "/v1/keys/{key_id}/rotate"): Operation(
        "keys", "Rotate an API key's secret", {200: json_answer(
            "ApiKeyRotated", "A new secret for the same key and settings; the old secret is refused at once.")},
        auth="manager", errors={400: INVALID, 404: ("key_not_found",)}),
    ("delete", "/v1/keys/{key_id}"): Operation(
        "keys", "Delete an API key", {200: json_answer("ApiKeyDeleted", "Deleted.")}, auth="manager",
        errors={400: INVALID, 404: ("key_not_found",)}),
    ("post", "/v1/shares"): Operation(
        "shares", "Share your machines with someone", {201: json_answer(
            "Share", "The share; the same answer whether or not the email has an account yet.")},
        auth="manager", body=_json_body("ShareCreate"), errors={400: INVALID, 404: ("machine_not_found",)},
        examples={"household": {"email": "partner@example.com", "daily_request_limit": 200},
                  "priced": {"email": "friend@example.com", "input_price": 20_000, "output_price": 80_000,
                             "expires_at": "2027-01-31T00:00:00Z"}}),
    ("patch", "/v1/shares/{share_id}"): Operation(
        "shares", "Change a share you gave", {200: json_answer("Share", "The share; pending again when its prices or "
                                                                        "machines changed.")},
        auth="manager", body=_json_body("ShareUpdate"), body_required=False,
        errors={400: INVALID, 404: ("share_not_found", "machine_not_found")}),
    ("post", "/v1/shares/accept"): Operation(
        "shares", "Accept a share with the invite code its owner gave you",
        {201: json_answer("Share", "The share, now yours and accepted.")}, auth="manager",
        body=_json_body("ShareInvite"), errors={400: INVALID, 404: ("share_not_found",)}),
    ("post", "/v1/shares/{share_id}/accept"): Operation(
        "shares", "Accept a share sent to your verified email address", {200: json_answer("Share", "Accepted.")},
        auth="manager", body=_json_body("ShareAnswer"), body_required=False,
        errors={400: INVALID, 403: ("email_not_verified",), 404: ("share_not_found",),
                409: ("share_terms_changed",)}),
    ("post", "/v1/shares/{share_id}/decline"): Operation(
        "shares", "Decline a share sent to you", {200: json_answer("Share", "Declined.")},
        auth="manager", body=_json_body("ShareAnswer"), body_required=False,
        errors={400: INVALID, 403: ("email_not_verified",), 404: ("share_not_found",),
                409: ("share_terms_changed",)}),
    ("get", "/v1/me"): Operation(
        "accounts", "Your account", {200: json_answer("Account", "Its email and whether you verified it.")},
        auth="caller"),
    ("post", "/v1/me/email/send-code"): Operation(
        "accounts", "Mail a code that verifies your email address",
        {202: json_answer("EmailCodeSent", "Sent (a new code replaces the last).")}, auth="manager",
        errors={400: INVALID, 409: ("email_already_verified",), 429: ("rate_limit_exceeded",),
                503: ("mail_unavailable",)},
        description="At most one code a minute; a code is valid 15 minutes and for 5 tries."),
    ("post", "/v1/me/email/verify"): Operation(
        "accounts", "Verify your email address with the mailed code",
        {200: json_answer("Account", "Verified.")}, auth="manager", body=_json_body("EmailCode"),
        errors={400: ("invalid_request_error", "invalid_code"), 410: ("expired_code",)}),
    ("get", "/v1/shares"): Operation(
        "shares", "Shares you gave and received", {200: json_answer("ShareLists", "Both lists.")}, auth="caller"),
    ("delete", "/v1/shares/{share_id}"): Operation(
        "shares", "Revoke a share (owner or grantee)", {204: Answer("Revoked.")}, auth="manager",
        errors={404: ("share_not_found",)}),
    ("get", "/v1/shares/{share_id}/usage"): Operation(
        "shares", "What a share used", {200: json_answer("ShareUsage", "Today (UTC) and the latest usage rows.")},
        auth="caller", errors={400: INVALID, 404: ("share_not_found",)}),
    ("post", "/v1/device/code"): Operation(
        "device", "Start a device login", {200: json_answer("DeviceCode", "Show user_code; poll with device_code.")}),
    ("post", "/v1/device/approve"): Operation(
        "device", "Approve a device's user_code", {200: json_answer("Status", "`{\"status\": \"approved\"}`.")},
        auth="manager", body=_json_body("DeviceApproval"),
        errors={400: INVALID, 404: ("invalid_code",), 409: ("already_used",), 410: ("expired_code",)}),
    ("post", "/v1/device/token"): Operation(
        "device", "Poll for the device token", {200: json_answer("DeviceToken", "Pending, or the token (once).")},
        body=_json_body("DeviceTokenRequest"),
        errors={400: INVALID, 404: ("invalid_grant",), 410: ("expired_token",)}),
    ("post", "/v1/admin/credit"): Operation(
        "admin", "Credit an account (idempotent on reference)", {200: json_answer("CreditResult", "New balance.")},
        auth="admin", body=_json_body("CreditRequest"), errors={400: INVALID, 404: ("account_not_found",)}),
    ("get", "/v1/admin/catalog"): Operation(
        "admin", "The model catalog", {200: json_answer("Catalog", "The catalog in force.")}, auth="admin"),
    ("put", "/v1/admin/catalog"): Operation(
        "admin", "Replace the model catalog", {200: json_answer("Catalog", "The stored catalog.")},
        auth="admin", body=_json_body("Catalog"), errors={400: INVALID}),
    ("post", "/v1/admin/machines/{machine_id}/enroll"): Operation(
        "admin", "Grant a machine hardware trust", {200: json_answer("Enrollment", "The certificate.")},
        auth="admin", errors={400: INVALID, 404: ("machine_not_found",),
                              409: ("machine_not_registered", "invalid_identity_key")}),
    ("get", "/console"): Operation("console", "Redirect to /console/", {308: Answer("To /console/.")}),
    ("get", "/console/"): Operation("console", "The console's chat page", {200: Answer("HTML.", {"text/html": "Html"})}),
    ("get", "/console/{page}"): Operation(
        "console", "A console page", {200: Answer("HTML.", {"text/html": "Html"})}, errors={404: ("not_found",)}),
    ("get", "/console/static/{name}"): Operation(
        "console", "A console script or stylesheet",
        {200: Answer("The file (ETag for revalidation).", {"*/*": "Binary"}),
         304: Answer("Not modified (If-None-Match matched the ETag).")}, errors={404: ("not_found",)}),
    ("post", "/v1/files"): Operation(
        "batches", "Upload a file", {200: json_answer("FileObject", "The stored file.")}, auth="caller",
        body={"multipart/form-data": "FileUpload"}, errors={400: INVALID, 413: ("request_too_large",)},
        description="A file of purpose `batch` is checked line by line first (JSONL of `{custom_id, method, url, "
                    "body}`); a bad line is a 400 naming its line number."),
    ("get", "/v1/files"): Operation(
        "batches", "List your files", {200: json_answer("FileList", "Newest first.")}, auth="caller",
        errors={400: INVALID}),
    ("get", "/v1/files/{file_id}"): Operation(
        "batches", "One file", {200: json_answer("FileObject", "The file.")}, auth="caller",
        errors={404: ("file_not_found",)}),
    ("get", "/v1/files/{file_id}/content"): Operation(
        "batches", "A file's content", {200: Answer(
            "The file's bytes: application/jsonl for a file whose name ends in .jsonl (every batch file and result "
            "file), else application/octet-stream.",
            {"application/jsonl": "FileContent", "application/octet-stream": "FileContent"})},
        auth="caller", errors={404: ("file_not_found",)}),
    ("delete", "/v1/files/{file_id}"): Operation(
        "batches", "Delete a file", {200: json_answer("FileDeleted", "Deleted.")}, auth="caller",
        errors={404: ("file_not_found",)}),
    ("post", "/v1/batches"): Operation(
        "batches", "Create a batch", {200: json_answer("Batch", "The batch, validating.")}, auth="caller",
        body=_json_body("BatchCreate"), route_headers=("X-Darkbloom-Route", "X-Darkbloom-Machine", "X-Darkbloom-Share"),
        errors=_BATCH_ROUTE_ERRORS,
        description="Each line of the input file runs as one request of `endpoint`, on the route the headers and "
                    "the key choose (as for a live request), at the lowest priority; fleet lines cost the live price "
                    "× the batch discount."),
    ("get", "/v1/batches"): Operation(
        "batches", "List your batches", {200: json_answer("BatchList", "Newest first.")}, auth="caller",
        errors={400: INVALID}),
    ("get", "/v1/batches/{batch_id}"): Operation(
        "batches", "One batch", {200: json_answer("Batch", "The batch, with its progress.")}, auth="caller",
        errors={404: ("batch_not_found",)}),
    ("post", "/v1/batches/{batch_id}/cancel"): Operation(
        "batches", "Cancel a batch", {200: json_answer("Batch", "The batch, cancelling (or already cancelled).")},
        auth="caller", body_required=False, errors={404: ("batch_not_found",), 409: ("batch_not_cancellable",)}),
}


def extra_schemas() -> dict[str, Any]:
    """Bodies that are not JSON objects of ours."""
    return {"MetricsText": {"type": "string"}, "Html": {"type": "string"},
            "Binary": {"type": "string", "format": "binary"},
            "OpenApiDocument": {"type": "object", "required": ["openapi", "info", "paths"]}}
