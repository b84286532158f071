"""JSON Schemas of the OpenAPI document's bodies (``components/schemas``): what every route takes
and answers. A request body's is its ``BodySchema``'s, the same type that validates it; answers are
described here."""

from __future__ import annotations

from typing import Any

from darkbloom.coordinator.batches.batch_api import BATCH_CREATE
from darkbloom.coordinator.http.routes.admin import CATALOG, CREDIT_REQUEST
from darkbloom.coordinator.identity.api_keys import KEY_CREATE, KEY_UPDATE
from darkbloom.coordinator.identity.console_login import LOGIN, SIGNUP
from darkbloom.coordinator.identity.device_login import DEVICE_APPROVAL, DEVICE_TOKEN_REQUEST
from darkbloom.coordinator.identity.email_verification import EMAIL_CODE
from darkbloom.coordinator.identity.shares import SHARE_ANSWER, SHARE_CREATE, SHARE_INVITE, SHARE_UPDATE
from darkbloom.wire.catalog import MAX_MODEL_ID
from darkbloom.wire.openai.body_schema import BodySchema
from darkbloom.wire.openai.chat_request import CHAT_REQUEST

Schema = dict[str, Any]

STRING: Schema = {"type": "string"}
INTEGER: Schema = {"type": "integer"}
BOOLEAN: Schema = {"type": "boolean"}
NULLABLE_STRING: Schema = {"type": ["string", "null"]}
NULLABLE_INTEGER: Schema = {"type": ["integer", "null"]}
TIMESTAMP: Schema = {"type": "integer", "description": "Unix time, seconds."}


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(properties: dict[str, Schema], required: tuple[str, ...] | None = None, **extra: Any) -> Schema:
    """An object with these properties, all required unless ``required`` names a subset."""
    return {"type": "object", "properties": properties,
            "required": list(properties if required is None else required), **extra}


def request_bodies(*bodies: BodySchema[Any]) -> dict[str, Schema]:
    """The schemas of request bodies and of every type they refer to, by name (one name, one type)."""
    found: dict[str, Schema] = {}
    for body in bodies:
        for name, schema in body.json_schemas().items():
            if found.setdefault(name, schema) != schema:
                raise ValueError(f"two request body types are named {name}")
    return found


def page_of(item: str, **extra: Schema) -> Schema:
    """A list (docs/api.md "Conventions"): ``{"object": "list", "data": [...], "next_cursor": str|null}``."""
    return obj({"object": {"const": "list"}, "data": {"type": "array", "items": ref(item)},
                "next_cursor": {**NULLABLE_STRING, "description": "Pass as ?cursor= for the next page."},
                **extra})


COST_MICRO_USD: Schema = {"type": "integer", "minimum": 0,
                          "description": "What the request was charged, in µUSD (0 when free): its usage row's "
                                         "`cost_micro_usd`, settled before the answer (or the stream's usage event) "
                                         "was sent."}
_USAGE = obj({"prompt_tokens": INTEGER, "completion_tokens": INTEGER, "total_tokens": INTEGER,
              "prompt_tokens_details": obj({"cached_tokens": {
                  "type": "integer", "minimum": 0,
                  "description": "Of `prompt_tokens`, those the node read from its cache (a prefix it still "
                                 "held from an earlier request) instead of evaluating; 0 when none. Billed as "
                                 "any prompt token."}}),
              "cost_micro_usd": COST_MICRO_USD})

_CHAT_COMPLETION = obj({
    "id": {"type": "string", "examples": ["chatcmpl-0123456789abcdef01234567"]},
    "object": {"const": "chat.completion"}, "created": TIMESTAMP,
    "model": {"type": "string", "description": "The model id the request asked for."},
    "choices": {"type": "array", "items": obj({
        "index": INTEGER,
        "message": obj({"role": {"const": "assistant"}, "content": NULLABLE_STRING,
                        "tool_calls": {"type": "array", "items": {"type": "object"}}}, ("role", "content")),
        "finish_reason": NULLABLE_STRING, "logprobs": {}}, ("index", "message", "finish_reason"))},
    "usage": ref("Usage"),
})

_CHAT_CHUNK = obj({
    "id": STRING, "object": {"const": "chat.completion.chunk"}, "created": TIMESTAMP, "model": STRING,
    "choices": {"type": "array", "items": obj({"index": INTEGER, "delta": {"type": "object"},
                                               "finish_reason": NULLABLE_STRING}, ("index",))},
    "usage": ref("Usage"),
}, ("id", "object", "model", "choices"))

_CHAT_EVENT = {
    "type": "object", "required": ["data"],
    "description": "One server-sent event (`text/event-stream`): a `data: {chat.completion.chunk}` line per "
                   "chunk, a final `choices: []` chunk with `usage` (its `cost_micro_usd` included) only when "
                   "`stream_options.include_usage` is true, then `data: [DONE]`. A failure after the first chunk ends the stream with one "
                   "`data: {\"error\": {...}}` event and no `[DONE]`. A sealed request gets each JSON event "
                   "sealed as `{\"ciphertext\": …}`.",
    "properties": {
        "data": {"anyOf": [{"const": "[DONE]"}, {
            "type": "string", "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [ref("ChatCompletionChunk"), ref("Error"), ref("SealedResponse")]}}]},
        "event": STRING, "id": STRING, "retry": INTEGER,
    },
}

_API_KEY = obj({
    "id": {"type": "string", "examples": ["key_0123456789abcdef"]}, "object": {"const": "api_key"},
    "name": STRING, "key_prefix": STRING, "self_route_only": BOOLEAN, "shared_only": BOOLEAN,
    "limit_usd": {"type": ["number", "null"]}, "limit_micro_usd": NULLABLE_INTEGER,
    "limit_reset": STRING, "fallback_limit_usd": {"type": ["number", "null"]},
    "fallback_limit_micro_usd": NULLABLE_INTEGER, "fallback_limit_reset": STRING,
    "expires_at": {"type": ["string", "null"], "format": "date-time"}, "disabled": BOOLEAN,
    "rpm_limit": NULLABLE_INTEGER, "itpm_limit": NULLABLE_INTEGER,
    "otpm_limit": NULLABLE_INTEGER, "allowed_models": {"type": ["array", "null"], "items": STRING},
    "max_shared_price": NULLABLE_INTEGER, "created_at": TIMESTAMP, "last_used_at": {"type": ["integer", "null"]},
})

_MACHINE = obj({
    "id": {"type": "string", "examples": ["mach_0123456789abcdef"]},
    "session_id": {**NULLABLE_STRING, "description": "The live prov_ session, or null when offline."},
    "name": STRING, "online": BOOLEAN, "models": {"type": "array", "items": STRING},
    "unverified_models": {"type": "array", "items": STRING, "description": (
        "Models it serves with other weights than the catalog pins (weight_hash): only your own requests "
        "reach it for them, and they earn nothing. Sorted; [] when offline.")},
    "trust_level": {"type": "string", "examples": ["none", "self_signed", "hardware", "untrusted"]},
    "private_only": BOOLEAN,
    "device": {**NULLABLE_STRING, "examples": ["cpu", "metal", "cuda"], "description": (
        "Where it runs its models: cpu, metal, cuda or another GPU backend of llama.cpp; null when offline "
        "or unknown (an openai-backend node, an older node).")},
    "backend": {**NULLABLE_STRING, "examples": ["llama-cpp", "openai"], "description": (
        "Its inference backend; null when offline or unknown.")},
    "last_seen": NULLABLE_INTEGER,
})

_ROUTES = obj({"owned": INTEGER, "shared": INTEGER, "fleet": INTEGER})
_MACHINE_STATS = obj({
    "hours": INTEGER, "requests": _ROUTES, "prompt_tokens": INTEGER, "completion_tokens": INTEGER,
    "earnings_micro_usd": {"type": "integer", "description": "Paid to you for what it served."},
    "busy_fraction": {"type": ["number", "null"], "description": (
        "Busy slots over slots, sampled every insight interval while online; null without samples.")},
    "decode_tps_p50": {"type": ["number", "null"], "description": (
        "Median of the sampled measured decode speed (tokens/s, to within 5 %); null before it was measured.")},
    "passed_over": obj({reason: INTEGER for reason in (
        "busy", "trust_floor", "private_only", "challenge_stale", "runtime_unverified", "capability",
        "unverified_weights", "context_length", "another_machine_chosen")}),
    "hourly": {"type": "array", "items": obj({"hour": TIMESTAMP, "owned": INTEGER, "shared": INTEGER,
                                              "fleet": INTEGER})},
})

_USAGE_ROW = obj({
    "request_id": STRING, "created_at": TIMESTAMP, "model": STRING, "provider_id": NULLABLE_STRING,
    "prompt_tokens": INTEGER, "completion_tokens": INTEGER,
    "cost_micro_usd": {"type": "integer", "description": "0 for self-routed requests served by your machine."},
    "self_routed": BOOLEAN, "routed": {"enum": ["owned", "shared", "fleet"]},
    "share_id": {"type": "string", "description": "The share that served (routed: shared)."},
    "ownership_changed": {"type": "boolean", "description": "An exclusive request whose machine changed owner "
                                                            "mid-flight: still free, nobody paid."},
    "batch_id": {"type": "string", "description": "A batch line's request: its batch (docs/batches.md)."},
    "custom_id": {"type": "string", "description": "A batch line's request: the line's custom_id."},
}, required=("request_id", "created_at", "model", "provider_id", "prompt_tokens", "completion_tokens",
             "cost_micro_usd", "self_routed", "routed"))

_SHARE = obj({
    "id": {"type": "string", "examples": ["shr_0123456789abcdef"]}, "object": {"const": "share"},
    "grantee_email": STRING,
    "machines": {"anyOf": [{"type": "array", "items": STRING}, {"const": "all"}]},
    "daily_request_limit": NULLABLE_INTEGER, "daily_token_limit": NULLABLE_INTEGER,
    "input_price": {"type": "integer", "description": "µUSD per 1M prompt tokens; 0 with output_price 0: free."},
    "output_price": INTEGER,
    "expires_at": {"type": ["string", "null"], "format": "date-time"}, "created_at": TIMESTAMP,
    "status": {"enum": ["pending", "accepted", "declined"], "description": (
        "Only an accepted share routes: pending until its grantee accepts, and again after a change of its prices "
        "or machines.")},
    "invite_code": {"type": "string", "description": (
        "POST /v1/shares only, shown once: hand it to the person you mean; they accept with POST /v1/shares/accept.")},
    "owner_email": {"type": "string", "description": "Received shares only."},
    "machine_names": {"type": "object", "additionalProperties": STRING,
                      "description": "Received shares only: the owner's machines it covers, by id."},
}, required=("id", "object", "grantee_email", "machines", "daily_request_limit", "daily_token_limit", "input_price",
             "output_price", "expires_at", "created_at", "status"))

_EARNINGS_ROW = obj({
    "request_id": STRING, "created_at": TIMESTAMP, "model": STRING, "provider_id": NULLABLE_STRING,
    "prompt_tokens": INTEGER, "completion_tokens": INTEGER, "payout_micro_usd": INTEGER,
})

_DEVICE_TOKEN = {"oneOf": [
    obj({"status": {"const": "authorization_pending"}}),
    obj({"status": {"const": "authorized"}, "token": {"type": "string", "description": "The dkp- device token."},
         "account_id": STRING, "machine_id": STRING}, ("status", "token", "account_id")),
]}

ERROR_ENVELOPE = obj({"error": obj({
    "message": {"type": "string", "description": "A sentence that says what to do next."},
    "type": STRING,
    "code": {**NULLABLE_STRING, "description": "Equal to `type` unless the route's table says otherwise."},
    "param": {**NULLABLE_STRING, "description": "The request field or header at fault, if any."},
}, additionalProperties=False)}, additionalProperties=False)


_FILE = obj({"id": STRING, "object": {"const": "file"}, "bytes": INTEGER, "created_at": TIMESTAMP,
             "filename": STRING, "purpose": {"enum": ["batch", "assistants", "fine-tune", "vision", "user_data", "evals",
                                                      "batch_output", "batch_error"]},
             "status": {"const": "processed"}, "status_details": {"type": "null"}})
_NULLABLE_TIMESTAMP: Schema = {"type": ["integer", "null"], "description": "Unix time, seconds; null until then."}
_BATCH = obj({
    "id": STRING, "object": {"const": "batch"}, "endpoint": STRING, "errors": {"type": "null"},
    "input_file_id": STRING, "completion_window": {"const": "24h"},
    "status": {"enum": ["validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
                        "cancelled"]},
    "output_file_id": NULLABLE_STRING, "error_file_id": NULLABLE_STRING, "created_at": TIMESTAMP,
    "expires_at": TIMESTAMP,
    **{name: _NULLABLE_TIMESTAMP for name in ("in_progress_at", "finalizing_at", "completed_at", "failed_at",
                                              "expired_at", "cancelling_at", "cancelled_at")},
    "request_counts": obj({"total": INTEGER, "completed": {**INTEGER, "description": "Lines answered."},
                           "failed": {**INTEGER, "description": "Lines in the error file (failed; once the batch "
                                                                "ends, expired and cancelled ones too)."}}),
    "metadata": {"type": ["object", "null"], "additionalProperties": STRING},
    "darkbloom_route": {"enum": ["self", "shared", "prefer", "fleet"]},
    "cost_micro_usd": {**INTEGER, "description": "What its lines were charged so far (their usage rows), µUSD."}})


SCHEMAS: dict[str, Schema] = {
    "Error": ERROR_ENVELOPE,
    **request_bodies(CHAT_REQUEST, SIGNUP, LOGIN, EMAIL_CODE, KEY_CREATE, KEY_UPDATE, SHARE_CREATE, SHARE_UPDATE,
                     SHARE_ANSWER, SHARE_INVITE, DEVICE_APPROVAL, DEVICE_TOKEN_REQUEST, CREDIT_REQUEST, CATALOG,
                     BATCH_CREATE),
    "ChatCompletion": _CHAT_COMPLETION, "ChatCompletionChunk": _CHAT_CHUNK, "ChatCompletionEvent": _CHAT_EVENT,
    "Usage": _USAGE,
    "SealedRequest": obj({"kid": STRING, "ephemeral_public_key": STRING, "ciphertext": STRING}, description=(
        "A JSON body sealed (NaCl box) to GET /v1/encryption-key; base64(nonce ‖ box).")),
    "SealedResponse": obj({"ciphertext": STRING}, description="The answer sealed back to your ephemeral key."),
    "Model": obj({"id": {"type": "string", "maxLength": MAX_MODEL_ID}, "object": {"const": "model"},
                  "created": TIMESTAMP, "owned_by": {"type": "string", "examples": ["darkbloom", "self"]}}),
    "ModelList": obj({"object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}}),
    "CatalogList": obj({"object": {"const": "list"}, "data": {"type": "array", "items": ref("CatalogModel")}}),
    "SelfRouteModels": obj({"models": {"type": "array", "items": STRING}}),
    "HealthStatus": obj({"status": {"const": "ok"}}),
    "ReadyStatus": obj({"status": {"enum": ["ready", "not_ready"]}, "database": {"enum": ["ok", "unreachable"]},
                        # with replicas (--nats-url) only: docs/replicas.md "Faults"
                        "nats": {"enum": ["connected", "disconnected"]},
                        "replicas": {"type": "integer", "minimum": 1},
                        "fabric": {"enum": ["in_sync", "out_of_sync"]},
                        "unsynced_replicas": {"type": "array", "items": STRING}},
                       required=("status", "database")),
    "EncryptionKey": obj({"kid": STRING, "public_key": STRING, "algorithm": {"const": "x25519-nacl-box"}}),
    "Session": obj({"account_id": STRING, "token": {"type": "string", "description": "The dks- session token."}}),
    "Status": obj({"status": STRING}),
    "Machine": _MACHINE, "MachineList": page_of("Machine"),
    "Unlinked": obj({"id": STRING, "deleted": {"const": True}}),
    "Balance": obj({"balance_micro_usd": INTEGER, "withdrawable_micro_usd": INTEGER}),
    "UsageRow": _USAGE_ROW, "UsagePage": page_of("UsageRow"),
    "UsageCsv": {"type": "string", "description": "CSV: request_id, created_at, model, provider_id, prompt_tokens, "
                                                  "completion_tokens, cost_micro_usd, self_routed, routed, share_id."},
    "UsageDaily": obj({"data": {"type": "array", "items": obj({
        "date": {"type": "string", "format": "date"}, "requests": INTEGER, "prompt_tokens": INTEGER,
        "completion_tokens": INTEGER, "cost_micro_usd": INTEGER})}}),
    "MachineStats": _MACHINE_STATS,
    "Share": _SHARE,
    "FileObject": _FILE,
    "FileList": obj({"object": {"const": "list"}, "data": {"type": "array", "items": ref("FileObject")},
                     "has_more": BOOLEAN, "first_id": NULLABLE_STRING, "last_id": NULLABLE_STRING}),
    "FileUpload": obj({"file": {"type": "string", "format": "binary"}, "purpose": {
        "enum": ["batch", "assistants", "fine-tune", "vision", "user_data", "evals"]}}),
    "FileContent": {"type": "string", "format": "binary"},
    "FileDeleted": obj({"id": STRING, "object": {"const": "file"}, "deleted": {"const": True}}),
    "Batch": _BATCH,
    "BatchList": obj({"object": {"const": "list"}, "data": {"type": "array", "items": ref("Batch")},
                      "has_more": BOOLEAN, "first_id": NULLABLE_STRING, "last_id": NULLABLE_STRING}),
    "Account": obj({"id": STRING, "object": {"const": "account"}, "email": NULLABLE_STRING,
                    "email_verified": BOOLEAN, "created_at": TIMESTAMP}),
    "EmailCodeSent": obj({"status": {"const": "sent"}, "email": STRING}),
    "ShareLists": obj({"given": {"type": "array", "items": ref("Share")},
                       "received": {"type": "array", "items": ref("Share")}}),
    "ShareUsage": obj({"share_id": STRING,
                       "today": obj({"requests": INTEGER, "prompt_tokens": INTEGER, "completion_tokens": INTEGER}),
                       "data": {"type": "array", "items": ref("UsageRow")}}),
    "EarningsRow": _EARNINGS_ROW, "EarningsPage": page_of("EarningsRow", total_micro_usd=INTEGER),
    "ApiKey": _API_KEY,
    "ApiKeyWithSecret": {"allOf": [ref("ApiKey"), obj({"key": {
        "type": "string", "description": "The dk- secret, shown only in this answer."}})]},
    "ApiKeyList": page_of("ApiKey"),
    "ApiKeyRotated": obj({"id": STRING, "object": {"const": "api_key"}, "key": {
        "type": "string", "description": "The new secret, shown only here; the old one is refused at once."}}),
    "ApiKeyDeleted": obj({"id": STRING, "object": {"const": "api_key"}, "deleted": {"const": True}}),
    "DeviceCode": obj({"device_code": STRING, "user_code": {"type": "string", "pattern": "^[A-Z2-9]{4}-[A-Z2-9]{4}$"},
                       "verification_uri": STRING, "verification_uri_complete": STRING,
                       "expires_in": INTEGER, "interval": INTEGER}),
    "DeviceToken": _DEVICE_TOKEN,
    "CreditResult": obj({"account_id": STRING, "balance_micro_usd": INTEGER}),
    "Enrollment": obj({"machine_id": STRING, "trust_level": {"const": "hardware"},
                       "certificate": {"type": "string", "description": "PEM, from the enrollment CA."}}),
}
