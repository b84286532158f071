"""The Files and Batch APIs' edges against hostile bodies (docs/batches.md): uploads that are not
multipart, carry two files, no purpose or an unknown one, a header-breaking file name, a declared
length over the upload limit; batch bodies with unknown fields, oversized metadata or ids. Each is a
named 400 (or 413) that stores nothing; a larger-than-request upload within the file limit is fine."""

from __future__ import annotations

import json
import socket
from typing import Iterator
from urllib.parse import urlsplit

import pytest

from tests.coordinator.http.conftest import Account, Api, assert_error

LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]}}


@pytest.fixture(scope="module")
def owner(api: Api) -> Iterator[Account]:
    yield api.signup()


def upload(api: Api, owner: Account, content: bytes, purpose: str | None = "batch", name: str = "in.jsonl",
           **extra: object) -> object:
    data = {"purpose": purpose} if purpose is not None else {}
    return api.post("/v1/files", headers=owner.auth, files={"file": (name, content, "application/jsonl")},
                    data=data, **extra)


def stored(api: Api, owner: Account) -> list[str]:
    return [f["id"] for f in api.get("/v1/files", headers=owner.auth).json()["data"]]


def test_uploads_that_are_not_one_file_and_a_purpose_are_refused(api: Api, owner: Account) -> None:
    before = stored(api, owner)
    assert_error(api.post("/v1/files", headers=owner.auth, json={"file": "x", "purpose": "batch"}), 400,
                 "invalid_request_error")
    assert_error(upload(api, owner, json.dumps(LINE).encode(), purpose=None), 400, "invalid_request_error")
    assert_error(upload(api, owner, json.dumps(LINE).encode(), purpose="fine-tuning-please"), 400,
                 "invalid_request_error")
    two = api.post("/v1/files", headers=owner.auth, data={"purpose": "batch"},
                   files=[("file", ("a.jsonl", b"{}", "text/plain")), ("file", ("b.jsonl", b"{}", "text/plain"))])
    assert_error(two, 400, "invalid_request_error")
    broken = api.post("/v1/files", headers={**owner.auth, "Content-Type": "multipart/form-data; boundary=xyz"},
                      content=b"--xyz\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nno end")
    assert broken.status_code == 400, broken.text
    assert stored(api, owner) == before


def test_a_header_breaking_file_name_is_stored_harmlessly(api: Api, owner: Account) -> None:
    response = upload(api, owner, b"notes", purpose="user_data", name='evil"\r\nX-Injected: yes.txt')
    assert response.status_code == 200, response.text  # type: ignore[attr-defined]
    content = api.get(f"/v1/files/{response.json()['id']}/content", headers=owner.auth)  # type: ignore[attr-defined]
    assert content.status_code == 200 and content.content == b"notes"
    assert "x-injected" not in content.headers
    assert "\r" not in content.headers["content-disposition"] and '"evil' in content.headers["content-disposition"]


def test_an_upload_over_the_request_limit_but_within_the_file_limit_is_stored(api: Api, owner: Account) -> None:
    pad = "x" * (3 * 1024 * 1024)
    content = b"".join(json.dumps({**LINE, "custom_id": f"big-{i}", "body": {
        **LINE["body"], "messages": [{"role": "user", "content": pad}]}}).encode() + b"\n" for i in range(3))
    assert len(content) > 8 * 1024 * 1024
    response = upload(api, owner, content)
    assert response.status_code == 200, response.text  # type: ignore[attr-defined]
    assert response.json()["bytes"] == len(content)  # type: ignore[attr-defined]


def test_a_declared_length_over_the_file_limit_is_413_before_it_is_read(api: Api, owner: Account) -> None:
    parts = urlsplit(api.coordinator.base_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\n"
                     + f"Authorization: {owner.auth['Authorization']}\r\n".encode()
                     + b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 200000000\r\n\r\n--b\r\n")
        answer = b""
        while b"request_too_large" not in answer and (part := sock.recv(65536)):  # headers and body may part
            answer += part
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer


@pytest.mark.parametrize("body, param", [
    ({"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h", "extra": 1},
     None),
    ({"input_file_id": "file-" + "x" * 5000, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
     "input_file_id"),
    ({"input_file_id": "file-x", "endpoint": "/v1/messages", "completion_window": "24h"}, "endpoint"),
    ({"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h",
      "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h",
      "metadata": {"k": "v" * 513}}, "metadata"),
    ({"input_file_id": 7, "endpoint": "/v1/chat/completions", "completion_window": "24h"}, "input_file_id"),
])
def test_hostile_batch_bodies_are_named_400s(api: Api, owner: Account, body: dict[str, object],
                                              param: str | None) -> None:
    error = assert_error(api.post("/v1/batches", headers=owner.auth, json=body), 400, "invalid_request_error")
    if param is not None:
        assert error["param"] == param or error["param"].startswith(param), error
    assert api.get("/v1/batches", headers=owner.auth).json()["data"] == []


def test_ids_that_are_not_the_callers_are_404(api: Api, owner: Account) -> None:
    for path in ("/v1/files/../../etc/passwd", "/v1/files/file-nope", "/v1/files/file-nope/content"):
        response = api.get(path, headers=owner.auth)
        assert response.status_code == 404, (path, response.text)
    assert_error(api.delete("/v1/files/file-nope", headers=owner.auth), 404, "file_not_found")
    assert_error(api.get("/v1/batches/batch_nope", headers=owner.auth), 404, "batch_not_found")
    assert_error(api.post("/v1/batches/batch_nope/cancel", headers=owner.auth), 404, "batch_not_found")
    assert_error(api.post("/v1/batches", headers=owner.auth, json={
        "input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
        404, "file_not_found")


def test_files_are_listed_newest_first_a_page_at_a_time(api: Api) -> None:
    owner = api.signup()
    made = [upload(api, owner, f"note {i}".encode(), purpose="user_data").json()  # type: ignore[attr-defined]
            for i in range(3)]
    newest_first = [f["id"] for f in sorted(made, key=lambda f: (f["created_at"], f["id"]), reverse=True)]
    first = api.get("/v1/files?limit=2", headers=owner.auth).json()
    assert first["has_more"] is True and [f["id"] for f in first["data"]] == newest_first[:2]
    rest = api.get(f"/v1/files?limit=2&after={first['last_id']}", headers=owner.auth).json()
    assert rest["has_more"] is False and [f["id"] for f in rest["data"]] == newest_first[2:]
    assert api.get("/v1/files?purpose=batch", headers=owner.auth).json()["data"] == []
    assert api.get(f"/v1/files?after={made[0]['id']}", headers=api.signup().auth).json()["data"] == []  # not theirs
