"""The HTTP edge against a real coordinator process: inputs the JSON layer can hold but later
layers could not (lone surrogates, NaN, deep nesting, over-long model ids, numbers where text
belongs) are refused with the envelope before anything is reserved; errors a retry cannot fix say
so (`x-should-retry: false`); CORS answers preflights only for configured origins."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.coordinator.http.conftest import Api, assert_error, bearer
from tests.support.processes import Coordinator, start_coordinator

SURROGATE_BODY = b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\\ud800"}]}'


def _chat(api: Api, raw: bytes, token: str) -> httpx.Response:
    return api.http.post("/v1/chat/completions", content=raw,
                         headers={**bearer(token), "content-type": "application/json"})


@pytest.mark.parametrize("raw,fragment", [
    (SURROGATE_BODY, "lone surrogate"),
    (b'{"model": "\\udfff", "messages": [{"role": "user", "content": "hi"}]}', "lone surrogate"),
    (b'{"model": "smollm2-135m", "temperature": NaN, "messages": [{"role": "user", "content": "hi"}]}',
     "not valid JSON"),
    (b'{"model": "smollm2-135m", "temperature": Infinity, "messages": [{"role": "user", "content": "hi"}]}',
     "not valid JSON"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 200
     + b"]" * 200 + b"}", "nests deeper"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 950
     + b"]" * 950 + b"}", ""),  # past the parser's own recursion limit: refused there
])
def test_inputs_later_layers_could_not_hold_are_a_400_envelope(api: Api, raw: bytes, fragment: str) -> None:
    account = api.signup()
    for headers in ({}, {"X-Darkbloom-Route": "self"}):
        response = api.http.post("/v1/chat/completions", content=raw,
                                 headers={**account.auth, **headers, "content-type": "application/json"})
        error = assert_error(response, 400, "invalid_request_error")
        assert fragment in error["message"]
        assert response.headers["x-should-retry"] == "false"


@pytest.mark.parametrize("path", ["/v1/auth/signup", "/v1/auth/login", "/v1/keys", "/v1/device/approve",
                                  "/v1/device/token"])
def test_account_routes_refuse_lone_surrogates_with_the_envelope(api: Api, path: str) -> None:
    account = api.signup()
    raw = b'{"email": "\\ud800@example.com", "password": "\\ud800xxxxxxxx", "name": "\\ud800", ' \
          b'"user_code": "\\ud800", "device_code": "\\ud800"}'
    response = api.http.post(path, content=raw, headers={**account.auth, "content-type": "application/json"})
    assert_error(response, 400, "invalid_request_error")


def test_an_over_long_model_id_is_model_not_found(api: Api) -> None:
    account = api.signup()
    for headers in ({}, {"X-Darkbloom-Route": "self"}, {"X-Darkbloom-Route": "prefer"}):
        response = api.http.post("/v1/chat/completions", headers={**account.auth, **headers},
                                 json={"model": "m" * 300, "messages": [{"role": "user", "content": "hi"}]})
        assert_error(response, 404, "model_not_found")


@pytest.mark.parametrize("fields,param", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": -0.5}, "top_p"),
])
def test_request_errors_are_refused_at_the_coordinator_with_their_param(api: Api, fields: dict[str, object],
                                                                        param: str) -> None:
    account = api.signup()
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], **fields}
    response = api.http.post("/v1/chat/completions", headers=account.auth, json=body)
    error = assert_error(response, 400, "invalid_request_error")
    assert error["param"] == param
    assert response.headers["x-should-retry"] == "false"


def test_errors_that_cannot_succeed_on_retry_say_so(api: Api) -> None:
    unauthenticated = api.http.get("/v1/models")
    assert unauthenticated.status_code == 401 and unauthenticated.headers["x-should-retry"] == "false"
    no_route = api.http.get("/v1/no-such-route")
    assert no_route.status_code == 404 and no_route.headers["x-should-retry"] == "false"
    account = api.signup()
    poor = api.http.post("/v1/chat/completions", headers=account.auth,
                         json={"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]})
    assert poor.status_code == 402 and poor.headers["x-should-retry"] == "false"


# CORS


@pytest.fixture(scope="module")
def cors_coord(tmp_path_factory: pytest.TempPathFactory, sqlite_url_module: str) -> Iterator[Coordinator]:
    home = tmp_path_factory.mktemp("cors")
    process = start_coordinator(home / "home", sqlite_url_module, "--cors-origins",
                                "https://app.example, https://other.example/")
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def sqlite_url_module(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite+aiosqlite:///{Path(tmp_path_factory.mktemp('cors-db')) / 'coordinator.db'}"


def test_preflight_from_an_allowed_origin_is_answered(cors_coord: Coordinator) -> None:
    response = httpx.options(cors_coord.base_url + "/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-darkbloom-route"})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "x-darkbloom-route" in response.headers["access-control-allow-headers"].lower()


def test_responses_to_an_allowed_origin_expose_the_routing_headers(cors_coord: Coordinator) -> None:
    response = httpx.get(cors_coord.base_url + "/v1/models", headers={"Origin": "https://other.example"})
    assert response.status_code == 401  # still needs a key; the browser may read the error
    assert response.headers["access-control-allow-origin"] == "https://other.example"
    exposed = response.headers["access-control-expose-headers"]
    assert "X-Darkbloom-Routed" in exposed
    # the rate-limit headers an answer carries (their names in money/ratelimit), so a browser can read them
    assert {"x-ratelimit-remaining-input-tokens", "x-ratelimit-reset-output-tokens"} <= set(exposed.split(", "))


def test_other_origins_get_no_cors_headers(cors_coord: Coordinator) -> None:
    response = httpx.options(cors_coord.base_url + "/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in response.headers
    assert response.status_code == 400 and response.json()["error"]["type"] == "cors_refused"


def test_without_cors_origins_nothing_is_allowed(api: Api) -> None:
    response = api.http.get("/v1/models", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in response.headers
