"""`darkbloom start --local`: direct mode with no coordinator running at all, then `darkbloom stop`."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from darkbloom.client import direct_first_openai
from darkbloom.provider.config import default_toml
from tests.provider.direct.support import MODEL, SHORT, docs_snippet, run_chat, run_python, wait_discovery
from tests.support.processes import _env, darkbloom_cmd, free_port

pytestmark = pytest.mark.e2e


def darkbloom(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(darkbloom_cmd(*args), env=_env(home), capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, object]]]:
    home = tmp_path_factory.mktemp("standalone")
    # provider.toml names a coordinator where nothing listens: no coordinator exists at all
    toml = default_toml(f"http://127.0.0.1:{free_port()}").replace("port = 8000", "port = 0")
    (home / "provider.toml").write_text(toml)
    started = darkbloom(home, "start", "--local")
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield home, wait_discovery(home)
    finally:
        stopped = darkbloom(home, "stop")
        assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout + stopped.stderr


def test_local_json_token_file_and_status(standalone: tuple[Path, dict[str, object]]) -> None:
    home, found = standalone
    token = (home / "local_token").read_text().strip()
    port = found["port"]
    assert found == {"base_url": f"http://127.0.0.1:{port}/v1", "api_key": token, "host": "127.0.0.1",
                     "port": port, "pid": int((home / "node.pid").read_text())}
    assert token.startswith("dk-local-") and len(token) >= len("dk-local-") + 43  # 32 random bytes
    for name in ("local_token", "local.json"):
        assert stat.S_IMODE((home / name).stat().st_mode) == 0o600, name
    status = darkbloom(home, "status")
    assert f"http://127.0.0.1:{port}/v1" in status.stdout and "direct mode only" in status.stdout, status.stdout


def test_health_is_open_and_everything_else_needs_the_token(standalone: tuple[Path, dict[str, object]]) -> None:
    _, found = standalone
    base = str(found["base_url"])
    root = base.removesuffix("/v1")
    assert httpx.get(root + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer dk-local-not-the-token"}):
        for response in (httpx.get(base + "/models", headers=headers),
                         httpx.post(base + "/chat/completions", headers=headers,
                                    json={"model": MODEL, "messages": SHORT})):
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="dk-local-wrong", max_retries=0).models.list()


def test_the_openai_sdk_gets_answers_with_no_coordinator(standalone: tuple[Path, dict[str, object]]) -> None:
    _, found = standalone
    plain = openai.OpenAI(base_url=str(found["base_url"]), api_key=str(found["api_key"]), max_retries=0)
    assert [m.id for m in plain.models.list()] == [MODEL]
    client = direct_first_openai(local_url=str(found["base_url"]), local_token=str(found["api_key"]),
                                 max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=SHORT, max_tokens=16)
    completion = raw.parse()
    assert raw.headers["X-Darkbloom-Via"] == "local"
    assert completion.choices[0].message.content and 0 < completion.usage.completion_tokens <= 16
    stream = client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert stream.response.headers["X-Darkbloom-Via"] == "local"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 16


def test_chat_local_first_and_the_docs_snippet(standalone: tuple[Path, dict[str, object]]) -> None:
    home, _ = standalone
    chat = run_chat(home, "--local-first", "--max-tokens", "16", "Name one planet.")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip() and chat.stderr.strip().splitlines() == ["via local"]
    # the coordinator in provider.toml does not exist: without --local-first there is nobody to answer
    plain = run_chat(home, "--api-key", "dk-anything", "Name one planet.")
    assert plain.returncode == 1 and "cannot reach" in plain.stderr
    snippet = run_python(docs_snippet(), home, {"DARKBLOOM_COORDINATOR": "", "DARKBLOOM_API_KEY": ""})
    assert snippet.returncode == 0, snippet.stderr
    lines = snippet.stdout.strip().splitlines()
    assert lines[0] == "via local" and lines[1].strip() and "via local" in lines[2:], snippet.stdout


def test_local_and_local_endpoint_together_exit_1(tmp_path: Path) -> None:
    result = darkbloom(tmp_path, "start", "--local", "--local-endpoint")
    assert result.returncode == 1 and "cannot be used together" in result.stderr


def test_stop_ends_the_node_and_its_endpoint(tmp_path: Path) -> None:
    home = tmp_path / "node"
    home.mkdir()
    (home / "provider.toml").write_text(default_toml(f"http://127.0.0.1:{free_port()}")
                                        .replace("port = 8000", "port = 0"))
    assert darkbloom(home, "start", "--local").returncode == 0
    try:
        found = wait_discovery(home)
        port = found["port"]
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        stopped = darkbloom(home, "stop")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert not (home / "local.json").exists() and not (home / "node.pid").exists()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")
    log = (home / "node.log").read_text()
    assert "connected to" not in log and "coordinator connection failed" not in log, log
    assert found["pid"] and "darkbloom.provider.node: node stopped" in log
    assert darkbloom(home, "status").stdout.count("not running") == 1
