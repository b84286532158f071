"""Bad input gets the OpenAI error envelope with the right status (docs/api.md "Bodies", "Error codes")."""

from __future__ import annotations

import json
from typing import Iterator

import httpx
import pytest

from tests.coordinator.http.conftest import Account, Api, assert_error, bearer

EIGHT_MIB = 8 * 1024 * 1024
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def caller(api: Api) -> Account:
    account = api.signup()
    api.credit(account, 10_000_000)  # paid requests need a balance before they reach routing
    return account


@pytest.fixture(scope="module")
def key(api: Api, caller: Account) -> dict[str, str]:
    return bearer(api.create_key(caller)["key"])


def _chat(api: Api, key: dict[str, str], **kwargs: object) -> httpx.Response:
    return api.post("/v1/chat/completions", headers={**key, "Content-Type": "application/json"}, **kwargs)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b'{"model": "smollm2-135m",'])
def test_malformed_json_is_400(api: Api, key: dict[str, str], raw: bytes) -> None:
    error = assert_error(_chat(api, key, content=raw), 400, "invalid_request_error")
    assert error["param"] is None


@pytest.mark.parametrize("raw", [b"[]", b"42", b'"text"', b"null"])
def test_non_object_body_is_400(api: Api, key: dict[str, str], raw: bytes) -> None:
    assert_error(_chat(api, key, content=raw), 400, "invalid_request_error")


@pytest.mark.parametrize("body", [{"messages": HELLO}, {"model": "", "messages": HELLO},
                                  {"model": "  ", "messages": HELLO}, {"model": 7, "messages": HELLO}])
def test_missing_model_is_400(api: Api, key: dict[str, str], body: dict) -> None:
    error = assert_error(_chat(api, key, json=body), 400, "invalid_request_error")
    assert error["param"] == "model"


@pytest.mark.parametrize("messages", [[], None, "hello", {"role": "user"}])
def test_empty_or_invalid_messages_is_400(api: Api, key: dict[str, str], messages: object) -> None:
    body = {"model": "smollm2-135m"} if messages is None else {"model": "smollm2-135m", "messages": messages}
    error = assert_error(_chat(api, key, json=body), 400, "invalid_request_error")
    assert error["param"] == "messages"


def test_message_without_role_is_400(api: Api, key: dict[str, str]) -> None:
    error = assert_error(_chat(api, key, json={"model": "smollm2-135m", "messages": [{"content": "hi"}]}),
                         400, "invalid_request_error")
    assert error["param"] == "messages[0]"


@pytest.mark.parametrize("n", [2, 10, 0, -1, "2", 1.5, True])
def test_n_other_than_one_is_400(api: Api, key: dict[str, str], n: object) -> None:
    error = assert_error(_chat(api, key, json={"model": "smollm2-135m", "messages": HELLO, "n": n}),
                         400, "invalid_request_error")
    assert error["param"] == "n"


@pytest.mark.parametrize("field, value", [("stream", "yes"), ("max_tokens", -1), ("max_tokens", "10"),
                                          ("max_completion_tokens", 1.5)])
def test_bad_typed_fields_are_400(api: Api, key: dict[str, str], field: str, value: object) -> None:
    error = assert_error(_chat(api, key, json={"model": "smollm2-135m", "messages": HELLO, field: value}),
                         400, "invalid_request_error")
    assert error["param"] == field


def _oversized_body() -> bytes:
    padding = "x" * (EIGHT_MIB + 16)
    return json.dumps({"model": "smollm2-135m", "messages": [{"role": "user", "content": padding}]}).encode()


def test_body_over_8_mib_with_content_length_is_413(api: Api, key: dict[str, str]) -> None:
    body = _oversized_body()
    resp = _chat(api, key, content=body)
    assert resp.request.headers["content-length"] == str(len(body))
    assert_error(resp, 413, "request_too_large")


def test_body_over_8_mib_chunked_is_413(api: Api, key: dict[str, str]) -> None:
    body = _oversized_body()

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 256 * 1024):
            yield body[start:start + 256 * 1024]

    resp = _chat(api, key, content=chunks())
    assert resp.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in resp.request.headers
    assert_error(resp, 413, "request_too_large")


def test_body_over_8_mib_on_other_routes_is_413(api: Api, caller: Account) -> None:
    huge = json.dumps({"name": "x" * (EIGHT_MIB + 1)}).encode()
    assert_error(api.post("/v1/keys", content=huge, headers={**caller.auth, "Content-Type": "application/json"}),
                 413, "request_too_large")

    def chunks() -> Iterator[bytes]:
        yield huge[: len(huge) // 2]
        yield huge[len(huge) // 2:]

    assert_error(api.post("/v1/auth/signup", content=chunks()), 413, "request_too_large")


def test_body_just_under_the_limit_is_read(api: Api, key: dict[str, str]) -> None:
    """A large body under 8 MiB is not rejected as too large: it reaches validation."""
    body = json.dumps({"model": "smollm2-135m", "messages": [], "pad": "x" * (EIGHT_MIB - 1024)}).encode()
    assert len(body) <= EIGHT_MIB
    error = assert_error(_chat(api, key, content=body), 400, "invalid_request_error")
    assert error["param"] == "messages"


@pytest.mark.parametrize("method, path", [("GET", "/v1/nothing-here"), ("POST", "/v1/chat/completion"),
                                          ("GET", "/"), ("DELETE", "/v1/admin/nothing")])
def test_unknown_route_is_404(api: Api, method: str, path: str) -> None:
    assert_error(api.request(method, path), 404, "not_found")


@pytest.mark.parametrize("method, path", [("GET", "/v1/chat/completions"), ("PUT", "/v1/keys"),
                                          ("DELETE", "/v1/auth/signup"), ("POST", "/health"),
                                          ("GET", "/v1/device/code")])
def test_wrong_method_is_405(api: Api, method: str, path: str) -> None:
    assert_error(api.request(method, path), 405, "method_not_allowed")


def test_unknown_model_is_404_model_not_found(api: Api, key: dict[str, str]) -> None:
    error = assert_error(_chat(api, key, json={"model": "no-such-model", "messages": HELLO}),
                         404, "model_not_found")
    assert error["param"] == "model"
    assert_error(api.get("/v1/models/no-such-model", headers=key), 404, "model_not_found")


@pytest.mark.parametrize("stream", [False, True])
def test_catalog_model_without_provider_is_503_model_unavailable(api: Api, key: dict[str, str],
                                                                 stream: bool) -> None:
    resp = _chat(api, key, json={"model": "smollm2-135m", "messages": HELLO, "stream": stream})
    assert_error(resp, 503, "model_unavailable")


def test_models_list_is_empty_without_providers(api: Api, key: dict[str, str]) -> None:
    resp = api.get("/v1/models", headers=key)
    assert resp.status_code == 200 and resp.json() == {"object": "list", "data": []}


@pytest.mark.parametrize("path", ["/v1/auth/signup", "/v1/auth/login", "/v1/device/token"])
def test_malformed_json_on_account_routes_is_400(api: Api, path: str) -> None:
    resp = api.post(path, content=b"{broken", headers={"Content-Type": "application/json"})
    assert_error(resp, 400, "invalid_request_error")
    resp = api.post(path, json=["not", "an", "object"])
    assert_error(resp, 400, "invalid_request_error")


def test_malformed_json_on_authenticated_routes_is_400(api: Api, caller: Account) -> None:
    key_id = api.create_key(caller)["id"]
    for method, path in (("POST", "/v1/keys"), ("PATCH", f"/v1/keys/{key_id}"), ("POST", "/v1/device/approve")):
        resp = api.request(method, path, content=b"{broken", headers={**caller.auth,
                                                                       "Content-Type": "application/json"})
        assert_error(resp, 400, "invalid_request_error")
    resp = api.post("/v1/admin/credit", content=b"{broken", headers=api.coordinator.admin())
    assert_error(resp, 400, "invalid_request_error")


def _nested(depth: int) -> bytes:
    return b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "x": ' + \
        b"[" * depth + b"]" * depth + b"}"


def test_deeply_nested_json_is_400(api: Api, key: dict[str, str], caller: Account) -> None:
    assert_error(_chat(api, key, content=_nested(100_000)), 400, "invalid_request_error")
    for path, headers in (("/v1/keys", caller.auth), ("/v1/auth/signup", {})):
        resp = api.post(path, content=b'{"name": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                        headers={**headers, "Content-Type": "application/json"})
        assert_error(resp, 400, "invalid_request_error")


def test_nested_json_within_reason_passes_through(api: Api, key: dict[str, str]) -> None:
    """Moderate nesting in an unknown field is fine: the request gets as far as routing."""
    assert_error(_chat(api, key, content=_nested(50)), 503, "model_unavailable")


def test_nul_characters_in_json_text_are_400(api: Api, caller: Account) -> None:
    nul = "a\x00b"
    key_id = api.create_key(caller)["id"]
    cases = [
        ("POST", "/v1/auth/signup", {"email": f"{nul}@example.com", "password": "longenough"}, {}),
        ("POST", "/v1/auth/login", {"email": f"{nul}@example.com", "password": "longenough"}, {}),
        ("POST", "/v1/keys", {"name": nul}, caller.auth),
        ("POST", "/v1/keys", {"name": "k", "allowed_models": [nul]}, caller.auth),
        ("PATCH", f"/v1/keys/{key_id}", {"name": nul}, caller.auth),
        ("POST", "/v1/device/approve", {"user_code": "AB\x00D-EFGH"}, caller.auth),
        ("POST", "/v1/device/token", {"device_code": nul}, {}),
        ("POST", "/v1/admin/credit", {"account_id": nul, "amount_micro_usd": 5, "reference": "r"},
         api.coordinator.admin()),
        ("POST", "/v1/admin/credit", {"email": nul, "amount_micro_usd": 5, "reference": "r"},
         api.coordinator.admin()),
        ("POST", "/v1/admin/credit", {"account_id": caller.account_id, "amount_micro_usd": 5, "reference": nul},
         api.coordinator.admin()),
        ("POST", "/v1/keys", {"name": "k", nul: 1}, caller.auth),
    ]
    for method, path, body, headers in cases:
        assert_error(api.request(method, path, json=body, headers=headers), 400, "invalid_request_error")
    assert api.get(f"/v1/keys/{key_id}", headers=caller.auth).json()["name"] == "test key"
    assert api.get("/v1/payments/balance", headers=caller.auth).json()["balance_micro_usd"] == 10_000_000


@pytest.mark.parametrize("method, path, params", [
    ("GET", "/v1/keys/key_%00", None),
    ("PATCH", "/v1/keys/key_%00", None),
    ("DELETE", "/v1/keys/key_%00", None),
    ("GET", "/v1/keys", {"cursor": "key_\x00"}),
    ("DELETE", "/v1/me/providers/mach_%00", None),
])
def test_nul_characters_in_ids_are_never_a_server_error(api: Api, caller: Account, method: str, path: str,
                                                        params: dict | None) -> None:
    resp = api.request(method, path, params=params, headers=caller.auth, json={} if method == "PATCH" else None)
    if resp.status_code == 200:  # SQLite can hold NUL: the cursor simply matches no later key
        assert path == "/v1/keys" and resp.json()["object"] == "list"
        return
    assert resp.status_code in (400, 404), resp.text
    assert_error(resp, resp.status_code, resp.json()["error"]["type"])


@pytest.mark.parametrize("raw", [b"[" * 200_000 + b"]" * 200_000,
                                 b'{"kid": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"])
def test_a_sealed_body_nested_past_any_recursion_limit_is_400(api: Api, key: dict[str, str], raw: bytes) -> None:
    resp = api.post("/v1/chat/completions", content=raw,
                    headers={**key, "Content-Type": "application/darkbloom-sealed+json"})
    error = assert_error(resp, 400, "invalid_sealed_envelope")
    assert "nests too deeply" in error["message"]
