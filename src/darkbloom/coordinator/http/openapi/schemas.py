"""JSON Schemas of the OpenAPI document's bodies (``components/schemas``): what every route takes
and answers. Documentation only: the routes parse their bodies by hand, with their own messages."""

from __future__ import annotations

from typing import Any

from darkbloom.wire.catalog import BUNDLED_MODEL_ID, MAX_MODEL_ID, Catalog

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


def page_of(item: str, **extra: Schema) -> Schema:
    """A list (docs/api.md "Conventions"): ``{"object": "list", "data": [...], "next_cursor": str|null}``."""
    return obj({"object": {"const": "list"}, "data": {"type": "array", "items": ref(item)},
                "next_cursor": {**NULLABLE_STRING, "description": "Pass as ?cursor= for the next page."},
                **extra})


_CONTENT_PART = {
    "type": "object", "required": ["type"], "additionalProperties": True,
    "description": "A typed content part; text parts (`text`, `input_text`) carry a string `text`.",
    "properties": {"type": STRING, "text": STRING, "image_url": {}},
}

_CHAT_MESSAGE = {
    "type": "object", "required": ["role"], "additionalProperties": True,
    "properties": {
        "role": {"type": "string", "examples": ["system", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "null"},
                              {"type": "array", "items": ref("ContentPart")}]},
        "name": STRING, "tool_calls": {"type": "array", "items": {"type": "object"}}, "tool_call_id": STRING,
    },
}


def _bounded_number(low: float, high: float) -> Schema:
    return {"type": ["number", "null"], "minimum": low, "maximum": high}


_CHAT_REQUEST = {
    "type": "object", "required": ["model", "messages"], "additionalProperties": True,
    "description": "OpenAI chat completions. Fields not listed pass through to the provider untouched.",
    "properties": {
        "model": {"type": "string", "minLength": 1, "examples": [BUNDLED_MODEL_ID],
                  "description": "A catalog model id or alias, or (self-routed) a model your own machines serve."},
        "messages": {"type": "array", "minItems": 1, "items": ref("ChatMessage")},
        "stream": {"type": ["boolean", "null"], "default": False},
        "stream_options": {"type": ["object", "null"], "properties": {"include_usage": BOOLEAN},
                           "description": "`include_usage: true` ends a stream with a `choices: []` usage chunk."},
        "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 1, "description": "Only 1 is supported."},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": _bounded_number(0, 2), "top_p": _bounded_number(0, 1),
        "presence_penalty": _bounded_number(-2, 2), "frequency_penalty": _bounded_number(-2, 2),
        "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": STRING}, {"type": "null"}]},
        "seed": NULLABLE_INTEGER,
        "tools": {"type": "array", "items": {"type": "object"}}, "tool_choice": {},
        "parallel_tool_calls": BOOLEAN,
        "functions": {"type": "array", "items": {"type": "object"}}, "function_call": {},
        "response_format": {"type": "object", "properties": {"type": {
            "type": "string", "examples": ["text", "json_object", "json_schema"]}}},
    },
}

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

_KEY_FIELDS = {
    "name": {"type": "string", "minLength": 1, "maxLength": 200},
    "self_route_only": {"type": "boolean", "description": "Serve only on your own machines, always free."},
    "shared_only": {"type": "boolean", "description": "Serve only on your own machines and those shared with you "
                                                      "(X-Darkbloom-Route: shared on every request)."},
    "limit_usd": {"type": ["number", "null"], "minimum": 0, "description": "Spend cap in US dollars (≤ 6 decimals)."},
    "limit_reset": {"enum": ["none", "daily", "weekly", "monthly"]},
    "fallback_limit_usd": {"type": ["number", "null"], "minimum": 0, "description": (
        "The most prefer requests on this key may spend on the public fleet per window, in US dollars; past it "
        "(or when a request's worst case would pass it) prefer acts as exclusive until the window resets.")},
    "fallback_limit_reset": {"enum": ["none", "daily", "weekly", "monthly"]},
    "expires_at": {"type": ["string", "null"], "format": "date-time", "description": (
        "ISO-8601, in the future (UTC when it names no offset); null: never expires. An expired key is 401 "
        "key_expired.")},
    "disabled": {"type": "boolean", "description": "A disabled key is 401 key_disabled until enabled again."},
    **{field: {"type": ["integer", "null"], "minimum": 1, "maximum": 2**31 - 1}
       for field in ("rpm_limit", "itpm_limit", "otpm_limit")},
    "allowed_models": {"type": ["array", "null"], "items": {"type": "string", "minLength": 1}},
    "max_shared_price": {"type": ["integer", "null"], "minimum": 0, "maximum": 10**12, "description": (
        "Shared routing on this key never uses a share whose input or output price (µUSD per 1M tokens) is above "
        "this; null: no ceiling.")},
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

_SHARE_TERMS = {
    "machines": {"anyOf": [{"type": "array", "items": STRING, "minItems": 1, "maxItems": 1000}, {"const": "all"},
                           {"type": "null"}], "description": "Left out (or null, or \"all\"): all your machines, "
                                                             "present and future."},
    "input_price": {"type": "integer", "minimum": 0}, "output_price": {"type": "integer", "minimum": 0},
}

_SHARE_CHANGES = {
    **_SHARE_TERMS,
    "daily_request_limit": {"type": ["integer", "null"], "minimum": 1},
    "daily_token_limit": {"type": ["integer", "null"], "minimum": 1},
    "expires_at": {"type": ["string", "null"], "format": "date-time"},
}
_SHARE_CREATE = obj({"email": {"type": "string", "format": "email", "maxLength": 320}, **_SHARE_CHANGES},
                    ("email",), additionalProperties=False)

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


def _catalog_schemas() -> dict[str, Schema]:
    """The catalog's own pydantic schema, so the document follows the model that validates it."""
    schema = Catalog.model_json_schema(ref_template="#/components/schemas/{model}")
    definitions = schema.pop("$defs", {})
    return {**definitions, "Catalog": schema}


SCHEMAS: dict[str, Schema] = {
    "Error": ERROR_ENVELOPE,
    "ChatCompletionRequest": _CHAT_REQUEST, "ChatMessage": _CHAT_MESSAGE, "ContentPart": _CONTENT_PART,
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
    "Credentials": obj({"email": {"type": "string", "format": "email", "maxLength": 320},
                        "password": {"type": "string", "minLength": 8, "maxLength": 1024}}),
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
    "Share": _SHARE, "ShareCreate": _SHARE_CREATE,
    "ShareUpdate": obj(_SHARE_CHANGES, (), additionalProperties=False, description=(
        "New prices or machines put the share back to pending until its grantee accepts them.")),
    "ShareAnswer": obj(_SHARE_TERMS, (), additionalProperties=False, description=(
        "Optionally the terms you were shown: a share whose terms differ now is not answered (409).")),
    "ShareInvite": obj({"invite_code": {"type": "string", "maxLength": 256}}, ("invite_code",),
                       additionalProperties=False),
    "Account": obj({"id": STRING, "object": {"const": "account"}, "email": NULLABLE_STRING,
                    "email_verified": BOOLEAN, "created_at": TIMESTAMP}),
    "EmailCodeSent": obj({"status": {"const": "sent"}, "email": STRING}),
    "EmailCode": obj({"code": {"type": "string", "maxLength": 64, "examples": ["ABCD-EFGH"]}}, ("code",)),
    "ShareLists": obj({"given": {"type": "array", "items": ref("Share")},
                       "received": {"type": "array", "items": ref("Share")}}),
    "ShareUsage": obj({"share_id": STRING,
                       "today": obj({"requests": INTEGER, "prompt_tokens": INTEGER, "completion_tokens": INTEGER}),
                       "data": {"type": "array", "items": ref("UsageRow")}}),
    "EarningsRow": _EARNINGS_ROW, "EarningsPage": page_of("EarningsRow", total_micro_usd=INTEGER),
    "ApiKeyCreate": obj(_KEY_FIELDS, ("name",), additionalProperties=False),
    "ApiKeyUpdate": obj(_KEY_FIELDS, (), additionalProperties=False),
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
    "DeviceApprove": obj({"user_code": {"type": "string", "examples": ["ABCD-EFGH"]}}),
    "DeviceTokenRequest": obj({"device_code": STRING}),
    "DeviceToken": _DEVICE_TOKEN,
    "CreditRequest": obj({"account_id": STRING, "email": STRING,
                          "amount_micro_usd": {"type": "integer", "minimum": 1, "maximum": 10**15},
                          "reference": {"type": "string", "minLength": 1, "maxLength": 200,
                                        "description": "Makes the credit idempotent."}},
                         ("amount_micro_usd", "reference"), description="Name the account by account_id or email."),
    "CreditResult": obj({"account_id": STRING, "balance_micro_usd": INTEGER}),
    "Enrollment": obj({"machine_id": STRING, "trust_level": {"const": "hardware"},
                       "certificate": {"type": "string", "description": "PEM, from the enrollment CA."}}),
    **_catalog_schemas(),
}
